"""Export a neox checkpoint as a Hugging Face model directory (config, safetensors, tokenizer).

Everything that can be refused (architecture, precision, tokenizer files, output directory) is
checked before any weight is read; the directory is built beside its target and renamed in.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch

from neox.checkpoint.adapter import read_reference
from neox.checkpoint.consolidate import (
    CheckpointError,
    load_model_state,
    read_checkpoint_config,
    read_lora_checkpoint,
    resolve_checkpoint,
)
from neox.checkpoint.hf_map import (
    check_exportable,
    hf_config_for,
    peft_target_modules,
    to_hf_state_dict,
    to_peft_state_dict,
)
from neox.checkpoint.hf_tokenizer import build_run_tokenizer, export_problem, save_hf_tokenizer
from neox.checkpoint.staging import check_output_dir, staged_directory
from neox.config import ConfigError, NeoXConfig, read_saved_config
from neox.config.derived import precision_of

log = logging.getLogger(__name__)

# gpt-neox's --architecture values -> hf_map's names.
ARCHITECTURES = {"neox": "gpt_neox", "llama": "llama"}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRECISIONS = ("auto", *DTYPES)
# How a LoRA run's checkpoint is written: the adapters folded into the weights, or the base
# model plus a PEFT adapter directory (ADAPTER_DIR inside the output) that `peft` loads onto it.
LORA_FORMATS = ("merged", "peft")
ADAPTER_DIR = "adapter"


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message names each problem and the fix."""


def export_dtype(precision: str, cfg: NeoXConfig) -> torch.dtype:
    """The dtype of the written weights: `precision`, or the run's own for "auto"."""
    if precision not in PRECISIONS:
        raise ExportError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    return DTYPES[precision_of(cfg) if precision == "auto" else precision]


def export_to_hf(
    input_dir: str | Path,
    output_dir: str | Path,
    *,
    iteration: Optional[int] = None,
    config_file: Optional[str | Path] = None,
    precision: str = "auto",
    architecture: str = "neox",
    overwrite: bool = False,
    trust: bool = False,
    lora_format: str = "merged",
) -> Optional[str]:
    """Write the checkpoint as an HF `architecture` model directory; returns a note when the
    tokenizer could not be exported (the model is written regardless). A LoRA adapter
    checkpoint is written with its adapters merged, or (lora_format="peft") as its base model
    plus a PEFT adapter in `output_dir/adapter`."""
    if architecture not in ARCHITECTURES:
        raise ExportError(f"architecture={architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    if lora_format not in LORA_FORMATS:
        raise ExportError(f"lora_format={lora_format!r} is not one of {', '.join(LORA_FORMATS)}")
    arch = ARCHITECTURES[architecture]
    tag_dir = resolve_checkpoint(input_dir, iteration)
    try:
        cfg = read_saved_config(config_file) if config_file else read_checkpoint_config(tag_dir)
        check_exportable(cfg.model, arch)
    except (ConfigError, ValueError) as e:
        raise ExportError(str(e)) from None
    dtype = export_dtype(precision, cfg)
    try:
        tokenizer = build_run_tokenizer(cfg.tokenizer)
    except (ValueError, OSError) as e:
        raise ExportError(f"cannot build the run's tokenizer: {e}") from None
    note = export_problem(cfg.tokenizer)
    peft = lora_format == "peft"
    if peft and read_reference(tag_dir) is None:
        raise ExportError(
            f"--lora_format peft: {tag_dir} holds no LoRA adapter (no lora_base.json); export it "
            "without the flag"
        )
    check_output_dir(Path(output_dir), overwrite, protected=[tag_dir])

    if peft:
        sd, adapters = read_lora_checkpoint(tag_dir, cfg, trust)
    else:
        _, sd = load_model_state(tag_dir, config=cfg, trust=trust)
    vocab = tokenizer.vocab_size
    if sd["embed_in.weight"].shape[0] < vocab:
        raise CheckpointError(
            f"the checkpoint has {sd['embed_in.weight'].shape[0]} vocabulary rows but the "
            f"tokenizer {vocab} ids; pass --config_file naming the tokenizer it trained with"
        )
    hf_sd = to_hf_state_dict(sd, cfg.model, vocab, arch)
    hf_sd = {k: v.to(dtype).contiguous() for k, v in hf_sd.items()}
    hf_config = hf_config_for(cfg.model, vocab, arch)
    special = dict(bos_token_id=tokenizer.eod, eos_token_id=tokenizer.eod)
    hf_config.update(special, dtype=str(dtype).removeprefix("torch."))
    hf_config["torch_dtype"] = hf_config["dtype"]  # the name transformers < 5 reads

    from safetensors.torch import save_file

    with staged_directory(Path(output_dir), overwrite) as tmp:
        save_file(hf_sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(special, indent=2) + "\n")
        if note is None:
            save_hf_tokenizer(cfg.tokenizer, tokenizer, tmp, cfg.model.shape.max_positions)
        if peft:
            peft_sd = to_peft_state_dict(adapters, cfg.model, arch)
            peft_sd = {k: v.to(dtype).contiguous() for k, v in peft_sd.items()}
            write_peft_adapter(tmp / ADAPTER_DIR, peft_sd, cfg, Path(output_dir).resolve())
    log.info("exported %s as HF %s (%s) to %s", tag_dir, arch, dtype, output_dir)
    if note:
        log.warning("%s; the model was written without tokenizer files", note)
    return note


def write_peft_adapter(
    directory: Path, peft_sd: dict[str, torch.Tensor], cfg: NeoXConfig, base: Path
) -> None:
    """adapter_config.json and adapter_model.safetensors as PEFT's save_pretrained writes them
    for a LoRA on a causal LM, its base the HF model exported at `base`."""
    from safetensors.torch import save_file

    lo = cfg.lora
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
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
