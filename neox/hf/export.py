"""Export a neox checkpoint as a Hugging Face model directory (config, safetensors, tokenizer).

Everything that can be refused (architecture, precision, shard size, tokenizer files, output
directory) is checked before any weight is read; the directory is built beside its target and
renamed in. A checkpoint imported by convert_from_hf.py exports as the family it came from
(hf_architecture), with the tokenizer files, generation config and chat template it carried
(hf_files) when the run still uses that tokenizer. Weights above `max_shard_size` are split into
shards with a `model.safetensors.index.json`, as transformers' save_pretrained writes them.

The weights stream: the checkpoint's files are memory-mapped and read one block at a time (the
embedding, final norm and head each alone), and each shard is written as soon as it is full,
so host memory stays near one shard. ZeRO-3 checkpoints (rebuilt from optimizer partitions)
and LoRA checkpoints are read whole; the files written are the same either way.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import torch

from neox.adapters.base_record import read_reference
from neox.checkpoint.consolidate import (
    CheckpointError,
    Source,
    layer_groups,
    lazy_model_state,
    load_model_state,
    read_checkpoint_config,
    read_lora_checkpoint,
    read_sources,
    resolve_checkpoint,
)
from neox.checkpoint.staging import check_output_dir, staged_directory
from neox.config import ConfigError, NeoXConfig, read_saved_config
from neox.config.derived import precision_of
from neox.hf.mapping import (
    ARCH_NAMES,
    HF_KEYS,
    check_exportable,
    hf_config_for,
    peft_target_modules,
    to_hf_state_dict,
    to_peft_state_dict,
)
from neox.hf.tokenizer_files import (
    carried_files,
    copy_carried_files,
    export_problem,
    imported_files,
    save_hf_tokenizer,
)
from neox.tokenizer.build import build_run_tokenizer

log = logging.getLogger(__name__)

# --architecture values (gpt-neox's neox|llama, then the newer families) -> hf_map's names.
ARCHITECTURES = {name: arch for arch, name in ARCH_NAMES.items()}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRECISIONS = ("auto", *DTYPES)
# transformers' save_pretrained default.
MAX_SHARD_SIZE = "5GB"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# How a LoRA run's checkpoint is written: the adapters folded into the weights, or the base
# model plus a PEFT adapter directory (ADAPTER_DIR inside the output) that `peft` loads onto it.
LORA_FORMATS = ("merged", "peft")
ADAPTER_DIR = "adapter"
SUFFIXES = ("weight", "bias")


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message names each problem and the fix."""


def export_dtype(precision: str, cfg: NeoXConfig) -> torch.dtype:
    """The dtype of the written weights: `precision`, or the run's own for "auto"."""
    if precision not in PRECISIONS:
        raise ExportError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    return DTYPES[precision_of(cfg) if precision == "auto" else precision]


def shard_bytes(size: str | int) -> int:
    """ "5GB" (10**9), "500MiB" (2**20) or a byte count -> bytes, as transformers reads them."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ExportError(
            f"max_shard_size={size!r} is not a size; write e.g. 5GB, 500MB, 2GiB or a byte count"
        )
    return int(float(m.group(1)) * UNITS[(m.group(2) or "").upper()])


class SafetensorsShards:
    """Writes tensors added in order as model.safetensors, or as shards of at most max_bytes (a
    tensor larger than that gets a shard of its own) with model.safetensors.index.json, as
    transformers' save_pretrained splits them. Each shard is written as soon as it is full, so
    at most one shard is held; its final name (which counts the shards) is given in `finish`."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = self.total = 0
        self.written: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f".shard-{len(self.written) + 1:05d}.partial"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.size = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, name the shards and write the index; returns the files."""
        self._flush()
        if len(self.written) == 1:
            self.written[0][0].rename(self.out / SINGLE_FILE)
            return [SINGLE_FILE]
        count = len(self.written)
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for file, (path, tensors) in zip(names, self.written):
            path.rename(self.out / file)
            weight_map.update(dict.fromkeys(tensors, file))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return [*names, INDEX_FILE]


def save_safetensors(hf_sd: dict[str, torch.Tensor], out: Path, max_bytes: int) -> list[str]:
    """Write hf_sd as model.safetensors, or as shards of at most max_bytes (a tensor larger
    than that gets a shard of its own) with model.safetensors.index.json; returns the files."""
    shards = SafetensorsShards(out, max_bytes)
    for name, tensor in hf_sd.items():
        shards.add(name, tensor)
    return shards.finish()


def stream_hf_weights(
    sources: dict[str, list[Source]],
    cfg: NeoXConfig,
    vocab: int,
    arch: str,
    dtype: torch.dtype,
    trust: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors in the order to_hf_state_dict gives them for the whole model, read and
    mapped one block (or the embedding, final norm, head) at a time."""
    tied: dict[str, torch.Tensor] = {}
    ln2 = HF_KEYS[arch]["layers.{}.post_attention_layernorm"]
    copies = [
        f"{ln2.format(i)}.{suffix}" for i in range(cfg.model.num_layers) for suffix in SUFFIXES
    ]
    for names in layer_groups(list(sources)):
        # Cast as read: casting commutes with the joins, splits and row cuts of the mapping,
        # so the bytes are those of casting the mapped tensors, at the export dtype's size.
        part = to_hf_state_dict(read_sources(sources, names, trust, dtype), cfg.model, vocab, arch)
        part = {name: tensor.contiguous() for name, tensor in part.items()}
        if cfg.model.gpt_j_tied:
            # to_hf_state_dict puts the shared norms' copies after every other tensor.
            tied.update({k: part.pop(k) for k in copies if k in part})
        yield from part.items()
        del part
    for name in copies:
        if name in tied:
            yield name, tied.pop(name)


def export_to_hf(
    input_dir: str | Path,
    output_dir: str | Path,
    *,
    iteration: Optional[int] = None,
    config_file: Optional[str | Path] = None,
    precision: str = "auto",
    architecture: Optional[str] = None,
    overwrite: bool = False,
    trust: bool = False,
    max_shard_size: str | int = MAX_SHARD_SIZE,
    lora_format: str = "merged",
    allow_unverified: bool = False,
) -> Optional[str]:
    """Write the checkpoint as an HF `architecture` model directory (None: the family it was
    imported from, else neox); returns a note when the tokenizer could not be exported (the
    model is written regardless). A LoRA adapter checkpoint is written with its adapters
    merged, or (lora_format="peft") as its base model plus a PEFT adapter in
    `output_dir/adapter`."""
    if architecture is not None and architecture not in ARCHITECTURES:
        raise ExportError(f"architecture={architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    if lora_format not in LORA_FORMATS:
        raise ExportError(f"lora_format={lora_format!r} is not one of {', '.join(LORA_FORMATS)}")
    max_bytes = shard_bytes(max_shard_size)
    tag_dir = resolve_checkpoint(input_dir, iteration, allow_unverified=allow_unverified)
    try:
        cfg = read_saved_config(config_file) if config_file else read_checkpoint_config(tag_dir)
        architecture = architecture or cfg.checkpoint.hf_architecture or "neox"
        arch = ARCHITECTURES[architecture]
        check_exportable(cfg.model, arch)
    except (ConfigError, ValueError) as e:
        raise ExportError(str(e)) from None
    if cfg.preference.train_impl == "rm":
        raise ExportError(
            f"{tag_dir} is a reward model (train_impl: rm): its output layer is a scalar head, "
            "not a language model's; exporting reward models to Hugging Face is not implemented"
        )
    dtype = export_dtype(precision, cfg)
    carried = carried_files(cfg)
    try:
        tokenizer = build_run_tokenizer(cfg.tokenizer)
    except (ValueError, OSError) as e:
        # An import whose tokenizer neox cannot build (Llama 3's has no <|endoftext|>) and a
        # run that named none: the imported files are the only tokenizer there is.
        carried = carried or imported_files(cfg)
        if carried is None:
            raise ExportError(f"cannot build the run's tokenizer: {e}") from None
        tokenizer = None
    note = None if carried is not None else export_problem(cfg.tokenizer)
    peft = lora_format == "peft"
    if peft and read_reference(tag_dir) is None:
        raise ExportError(
            f"--lora_format peft: {tag_dir} holds no LoRA adapter (no lora_base.json); export it "
            "without the flag"
        )
    check_output_dir(Path(output_dir), overwrite, protected=[tag_dir])

    # The checkpoint's files are read a block at a time where their layout allows (pp=1 and
    # pipeline files: flat engine, ZeRO 0-2, any tp); ZeRO-3's partitions and LoRA adapter
    # checkpoints (base plus adapters, merged or written apart) are read whole.
    lazy = None if peft else lazy_model_state(tag_dir, cfg, trust)
    if peft:
        sd, adapters = read_lora_checkpoint(tag_dir, cfg, trust)
    elif lazy is None:
        _, sd = load_model_state(
            tag_dir, config=cfg, trust=trust, allow_unverified=allow_unverified
        )
    else:
        sd, sources = lazy  # meta tensors: names and shapes only
    if carried is not None:
        # The imported model's own rows (Qwen's exceed its tokenizer's) and token ids.
        try:
            original = json.loads((carried / "config.json").read_text())
            rows = original["vocab_size"]
        except (ValueError, KeyError, TypeError) as e:
            raise ExportError(
                f"{carried / 'config.json'} (the imported model's, hf_files) is damaged "
                f"({type(e).__name__}: {e}); import the model again, or pass --config_file "
                "without hf_files"
            ) from None
        vocab = max(tokenizer.vocab_size if tokenizer else 0, rows)
        special = {k: original[k] for k in SPECIAL_IDS if original.get(k) is not None}
    else:
        vocab = tokenizer.vocab_size
        special = dict(bos_token_id=tokenizer.eod, eos_token_id=tokenizer.eod)
    if sd["embed_in.weight"].shape[0] < vocab:
        raise CheckpointError(
            f"the checkpoint has {sd['embed_in.weight'].shape[0]} vocabulary rows but the "
            f"tokenizer {vocab} ids; pass --config_file naming the tokenizer it trained with"
        )
    if lazy is None:
        hf_sd = to_hf_state_dict(sd, cfg.model, vocab, arch)
        del sd
        weights = ((k, v.to(dtype).contiguous()) for k, v in hf_sd.items())
    else:
        weights = stream_hf_weights(sources, cfg, vocab, arch, dtype, trust)
    hf_config = hf_config_for(cfg.model, vocab, arch)
    hf_config.update(special, dtype=str(dtype).removeprefix("torch."))
    hf_config["torch_dtype"] = hf_config["dtype"]  # the name transformers < 5 reads

    with staged_directory(Path(output_dir), overwrite) as tmp:
        shards = SafetensorsShards(tmp, max_bytes)
        for name, tensor in weights:
            shards.add(name, tensor)
        shards.finish()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if carried is not None:
            copy_carried_files(carried, tmp)
        else:
            (tmp / "generation_config.json").write_text(json.dumps(special, indent=2) + "\n")
            if note is None:
                save_hf_tokenizer(cfg.tokenizer, tokenizer, tmp, cfg.model.shape.max_positions)
        if peft:
            peft_sd = to_peft_state_dict(adapters, cfg.model, arch)
            peft_sd = {k: v.to(dtype).contiguous() for k, v in peft_sd.items()}
            # The base as imported, when exported as the family it came from: the adapter
            # then loads on the original model, wherever this export lives.
            imported = architecture == cfg.checkpoint.hf_architecture and cfg.checkpoint.hf_source
            base = imported or str(Path(output_dir).resolve())
            write_peft_adapter(tmp / ADAPTER_DIR, peft_sd, cfg, base)
    log.info("exported %s as HF %s (%s) to %s", tag_dir, arch, dtype, output_dir)
    if note:
        log.warning("%s; the model was written without tokenizer files", note)
    return note


def write_peft_adapter(
    directory: Path, peft_sd: dict[str, torch.Tensor], cfg: NeoXConfig, base: str
) -> None:
    """adapter_config.json and adapter_model.safetensors as PEFT's save_pretrained writes them
    for a LoRA on a causal LM, its base the HF model `base` (a hub name or path)."""
    from safetensors.torch import save_file

    lo = cfg.lora
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lo.lora_rank,
        "lora_alpha": lo.lora_alpha,
        "lora_dropout": lo.lora_dropout,
        "target_modules": peft_target_modules(peft_sd),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    directory.mkdir()
    save_file(peft_sd, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
