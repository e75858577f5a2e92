"""Read any checkpoint train.py wrote back into the full plain-GPTNeoX state dict.

train.py's checkpoints hold the weights by plain name (state/, neox/checkpoint/plain_state.py),
read first. Checkpoints in DeepSpeed's files (gpt-neox's, DeepSpeed's, the conversion tools',
neox's before state/) are read too. The files DeepSpeed writes in a `global_stepN` directory depend on the layout that trained it
(neox/checkpoint/ds_files.py names them): one module file per tp rank, one per pipeline layer and
tp rank, or ZeRO-3's placeholders, whose weights are rebuilt from the fp32 optimizer partitions
by DeepSpeed's zero_to_fp32.
Tensor-parallel shards are joined along the dimension the training layer split them
(TENSOR_PARALLEL_PLAN and the layers' PARTITION_DIMS). The padded vocabulary is read from the
embedding's shape, so neither the tokenizer nor the training world size is needed.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from neox.adapters.base_record import base_problem, read_reference
from neox.checkpoint.compat import read_checkpoint_config_file
from neox.checkpoint.ds_files import (
    ANY_MODEL_FILES,
    LAYER_FILE,
    LAYER_FILES,
    MODEL_STATES,
    MP_FILE,
    MP_FILES,
    ZERO3_FILE,
    ZERO3_FILES,
    has_model_states,
    optim_file_of,
)
from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.find import (
    has_plain_state,
    latest_tag,
    step_tags,
    tag_for,
    unverified_problem,
)
from neox.checkpoint.manifest import MANIFEST, manifest_problem
from neox.checkpoint.plain_state import plain_state_dict
from neox.checkpoint.trust import check_loadable, load_file
from neox.config import ConfigError, NeoXConfig
from neox.model import GPTNeoX, build_model
from neox.model.transforms.lora import is_adapter, lora_partition_dim, merge_lora
from neox.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from neox.parallel.tensor import TENSOR_PARALLEL_PLAN

log = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]


PLAN_LAYERS = {
    "column": ColumnParallelLinear,
    "row": RowParallelLinear,
    "vocab": VocabParallelEmbedding,
}


def _tags(directory: Path) -> list[str]:
    """Checkpoint directories, oldest first."""
    return step_tags(directory)[::-1]


def _is_tag_dir(path: Path) -> bool:
    return has_model_states(path) or has_plain_state(path)


def resolve_checkpoint(
    path: str | Path,
    iteration: Optional[int] = None,
    require_config: bool = True,
    allow_unverified: bool = False,
) -> Path:
    """The `global_stepN` directory for `path`: a save directory (its `latest`, or
    global_step{iteration}) or one global_stepN directory itself. A checkpoint neox wrote
    whose manifest is gone is refused unless `allow_unverified`."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint path {path} does not exist; pass the directory a run saved to (its "
            "`save` key) or one of its global_stepN directories"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint path {path} is a file; pass the directory a run saved to (its `save` "
            "key) or one of its global_stepN directories"
        )
    if _is_tag_dir(path):
        if iteration is not None and path.name != tag_for(iteration):
            raise CheckpointError(
                f"{path} is the checkpoint {path.name}, not iteration {iteration}; pass its "
                f"parent directory with iteration={iteration}, or leave iteration out"
            )
        tag_dir = path
    else:
        tags = _tags(path)
        found = f"found: {', '.join(tags)}" if tags else "it holds no global_stepN directories"
        if iteration is not None:
            tag_dir = path / tag_for(iteration)
            if not tag_dir.is_dir():
                raise CheckpointError(
                    f"{path} has no checkpoint for iteration {iteration} ({found}); "
                    "pass one of those iterations"
                )
        else:
            latest = path / "latest"
            if not latest.is_file():
                raise CheckpointError(
                    f"{path} has no `latest` file ({found}); pass an iteration or one "
                    "global_stepN directory"
                )
            tag, garbage = latest_tag(path)
            if garbage:
                raise CheckpointError(
                    f"ignoring {garbage}; pass an iteration or one global_stepN directory ({found})"
                )
            tag_dir = path / tag
            if not tag_dir.is_dir():
                raise CheckpointError(
                    f"{latest} names {tag!r}, which is not a directory in {path} ({found}); "
                    "pass an iteration or one global_stepN directory"
                )
        if not _is_tag_dir(tag_dir):
            raise CheckpointError(
                f"{tag_dir} holds no DeepSpeed {MODEL_STATES} files nor state/; the save did not "
                "finish or this is not a checkpoint directory: pass another iteration"
            )
    if require_config and not (tag_dir / "config.yml").is_file():
        raise CheckpointError(
            f"{tag_dir} has no config.yml, so the model it holds is unknown; pass a "
            "checkpoint written by neox's train.py (it saves config.yml in every global_stepN)"
        )
    if not allow_unverified and (problem := unverified_problem(tag_dir)):
        raise CheckpointError(problem)
    return tag_dir


def lora_base_dir(cfg: NeoXConfig) -> Optional[Path]:
    """The global_stepN directory `lora_base` names (None without lora_base)."""
    base = cfg.lora.lora_base
    allow = cfg.checkpoint.allow_unverified_checkpoint
    return None if base is None else resolve_checkpoint(base, allow_unverified=allow)


def verify_files(tag_dir: Path, paths: list[Path]) -> None:
    """CheckpointError unless `paths` (and config.yml) match the checksums of the manifest."""
    names = [str(p.relative_to(tag_dir)) for p in paths] + ["config.yml"]
    problem = manifest_problem(tag_dir, verify=True, only=names)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {tag_dir} cannot be used: {problem}; pass another iteration (or "
            f"restore the file from a copy)"
        )
    if not (tag_dir / MANIFEST).is_file():
        log.info("%s has no %s: its files' checksums cannot be checked", tag_dir, MANIFEST)


def partition_dim(name: str) -> Optional[int]:
    """The dim along which tensor parallelism splits parameter `name`, or None (replicated)."""
    if is_adapter(name):
        return lora_partition_dim(name)
    module, _, param = name.rpartition(".")
    for suffix, kind in TENSOR_PARALLEL_PLAN.items():
        if module == suffix or module.endswith("." + suffix):
            return PLAN_LAYERS[kind].PARTITION_DIMS.get(param)
    return None


def _ranked(files: list[tuple[int, Any]], tp: int, what: str, directory: Path) -> list[Any]:
    """Per-rank items for ranks 0..tp-1 (tp from the saved config), all present."""
    by_rank = dict(files)
    missing = [r for r in range(tp) if r not in by_rank]
    extra = sorted(r for r in by_rank if r >= tp)
    if missing:
        raise CheckpointError(
            f"{directory} lacks the {what} of tensor-parallel rank(s) {missing}: the save is "
            "incomplete; pass another iteration"
        )
    if extra:
        raise CheckpointError(
            f"{directory} has {what} for tensor-parallel rank(s) {extra}, beyond its config's "
            f"model_parallel_size={tp}: was config.yml edited? Pass the config it trained with"
        )
    return [by_rank[r] for r in range(tp)]


def _mp_shards(tag_dir: Path, tp: int, trust: bool) -> list[StateDict]:
    files = [(int(m.group(1)), p) for p in tag_dir.iterdir() if (m := MP_FILE.match(p.name))]
    paths = _ranked(files, tp, MP_FILES, tag_dir)
    verify_files(tag_dir, paths)
    shards = []
    for path in paths:
        module = load_file(path, trust).get("module")
        if module is None:
            raise CheckpointError(f"{path} holds no module weights; it is not a pp=1 checkpoint")
        shards.append(dict(module))
    return shards


def _pipeline_shards(tag_dir: Path, tp: int, num_layers: int, trust: bool) -> list[StateDict]:
    by_tp: dict[int, StateDict] = {}
    paths = sorted(p for p in tag_dir.iterdir() if LAYER_FILE.match(p.name))
    verify_files(tag_dir, paths)
    for path in paths:
        m = LAYER_FILE.match(path.name)
        layer, tp_rank = int(m.group(1)), int(m.group(2))
        # Blocks are layers 1..L; the embedding, final norm and head keep their plain names.
        prefix = f"layers.{layer - 1}." if 1 <= layer <= num_layers else ""
        shard = by_tp.setdefault(tp_rank, {})
        shard.update({prefix + k: v for k, v in load_file(path, trust).items()})
    return _ranked(list(by_tp.items()), tp, LAYER_FILES, tag_dir)


def _zero3_shards(tag_dir: Path, tp: int, trust: bool) -> list[StateDict]:
    """Each tp rank's fp32 weights, gathered from its ZeRO-3 optimizer partitions."""
    from deepspeed.utils.zero_to_fp32 import (
        _get_fp32_state_dict_from_zero3_checkpoint,
        parse_model_states,
        parse_optim_states,
        to_torch_tensor,
    )

    files = [(int(m.group(2)), p) for p in tag_dir.iterdir() if (m := ZERO3_FILE.match(p.name))]
    shards = []
    _ranked(files, tp, ZERO3_FILES, tag_dir)
    # zero_to_fp32 unpickles with weights_only=False: every file it reads is checked first.
    paths = [p for _, p in files] + [Path(optim_file_of(p)) for _, p in files]
    verify_files(tag_dir, [p for p in paths if p.is_file()])
    for path in paths:
        if path.is_file():
            check_loadable(path, trust)
    for tp_rank in range(tp):
        model_files = sorted(str(p) for r, p in files if r == tp_rank)
        optim_files = sorted(optim_file_of(p) for p in model_files)
        # DeepSpeed's helpers print progress; keep it out of the caller's output.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            states = parse_model_states(model_files)
            _, world, flat_groups, _ = parse_optim_states(optim_files, str(tag_dir))
            sd = _get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, states, False)
        log.info("gathered tp rank %d's weights from %d ZeRO-3 partitions", tp_rank, world)
        shards.append(to_torch_tensor(sd))
    return shards


def read_shards(tag_dir: Path, tp: int, num_layers: int, trust: bool = False) -> list[StateDict]:
    """One plain-named state dict per tensor-parallel rank (tp of them), whatever the layout;
    the files read are checked against the manifest's checksums first."""
    names = [p.name for p in tag_dir.iterdir()]
    if any(LAYER_FILE.match(n) for n in names):
        return _pipeline_shards(tag_dir, tp, num_layers, trust)
    if any(MP_FILE.match(n) for n in names):
        return _mp_shards(tag_dir, tp, trust)
    if any(ZERO3_FILE.match(n) for n in names):
        return _zero3_shards(tag_dir, tp, trust)
    raise CheckpointError(
        f"{tag_dir} holds no model state files DeepSpeed writes ({ANY_MODEL_FILES}); "
        "pass a checkpoint directory train.py saved"
    )


# Where one rank's slice of a tensor lies: the file, the key of the dict holding the module in it
# (None: the file is the module, as a pipeline layer file is), the tensor's name there.
Source = tuple[Path, Optional[str], str]


def _mapped(path: Path, trust: bool) -> Any:
    """The file loaded memory-mapped: its tensors are read from disk only when touched."""
    return load_file(path, trust, mmap=True)


def _lazy_rank_sources(
    tag_dir: Path, tp: int, num_layers: int, trust: bool
) -> Optional[list[dict[str, tuple[Source, torch.Size]]]]:
    """Per tp rank, each plain name's source and shape, in the order read_shards gives them;
    None for ZeRO-3 (its weights are gathered from optimizer partitions) and for legacy
    (non-zip) files that cannot be memory-mapped."""
    names = [p.name for p in tag_dir.iterdir()]
    try:
        if any(LAYER_FILE.match(n) for n in names):
            by_tp: dict[int, dict[str, tuple[Source, torch.Size]]] = {}
            paths = sorted(p for p in tag_dir.iterdir() if LAYER_FILE.match(p.name))
            verify_files(tag_dir, paths)
            for path in paths:
                m = LAYER_FILE.match(path.name)
                layer, tp_rank = int(m.group(1)), int(m.group(2))
                prefix = f"layers.{layer - 1}." if 1 <= layer <= num_layers else ""
                found = by_tp.setdefault(tp_rank, {})
                for k, v in _mapped(path, trust).items():
                    found[prefix + k] = ((path, None, k), v.shape)
            return _ranked(list(by_tp.items()), tp, LAYER_FILES, tag_dir)
        if any(MP_FILE.match(n) for n in names):
            files = [
                (int(m.group(1)), p) for p in tag_dir.iterdir() if (m := MP_FILE.match(p.name))
            ]
            paths = _ranked(files, tp, MP_FILES, tag_dir)
            verify_files(tag_dir, paths)
            ranks = []
            for path in paths:
                module = _mapped(path, trust).get("module")
                if module is None:
                    raise CheckpointError(
                        f"{path} holds no module weights; it is not a pp=1 checkpoint"
                    )
                ranks.append({k: ((path, "module", k), v.shape) for k, v in module.items()})
            return ranks
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
    return None


def lazy_model_state(
    tag_dir: Path, cfg: NeoXConfig, trust: bool = False
) -> Optional[tuple[StateDict, dict[str, list[Source]]]]:
    """(the full state dict as meta tensors of the merged shapes, each name's per-rank sources)
    in load_model_state's order and checked as it checks, without reading a weight; None where
    the checkpoint must be read whole (state/, ZeRO-3, legacy files, LoRA adapters)."""
    if read_reference(tag_dir) is not None or has_plain_state(tag_dir):
        return None  # state/ is read whole, rounded to the training precision
    if not has_model_states(tag_dir):
        return None
    tp = cfg.parallel.model_parallel_size
    ranks = _lazy_rank_sources(tag_dir, tp, cfg.model.num_layers, trust)
    if ranks is None:
        return None
    meta, sources = {}, {}
    for name, (source, shape) in ranks[0].items():
        dim = partition_dim(name)
        if dim is None or tp == 1:
            sources[name] = [source]
        else:
            sources[name] = [rank[name][0] for rank in ranks]
            shape = list(shape)
            shape[dim] = sum(rank[name][1][dim] for rank in ranks)
        meta[name] = torch.empty(shape, device="meta")
    if "embed_in.weight" not in meta:
        raise CheckpointError(f"{tag_dir} holds no embed_in.weight; it is not a neox checkpoint")
    padded_vocab = meta["embed_in.weight"].shape[0]
    check_state_dict(meta, build_model(cfg.model, padded_vocab, device="meta"), tag_dir)
    return meta, sources


def read_sources(
    sources: dict[str, list[Source]],
    names: list[str],
    trust: bool = False,
    dtype: Optional[torch.dtype] = None,
) -> StateDict:
    """The merged tensors `names` (tp slices joined as merge_tensor_parallel joins them), each
    slice cast to `dtype` (None: as saved) as it is read, in memory of their own. Each file is
    memory-mapped once per call (callers pass one block's names: layer_groups), so the pages
    resident are those of the block's slices, not the file's; mapping it once per slice instead
    would parse a whole-model file's index once per tensor."""
    mapped: dict[Path, Any] = {}
    out = {}
    for name in names:
        parts = []
        for path, container, key in sources[name]:
            if path not in mapped:
                mapped[path] = _mapped(path, trust)
            loaded = mapped[path]
            part = (loaded if container is None else loaded[container])[key]
            cast = dtype is not None and part.dtype != dtype
            parts.append(part.to(dtype) if cast else part)
            del part
        if len(parts) > 1:
            out[name] = torch.cat(parts, dim=partition_dim(name))
        else:
            # A copy unless the cast made one: a view would keep the mapping, and every page
            # of it read so far, resident for as long as the tensor lives.
            out[name] = parts[0] if cast else parts[0].clone()
        del parts
    del mapped  # the block's pages go with the mappings: `out` holds copies
    return out


def layer_groups(names: list[str]) -> list[list[str]]:
    """Consecutive names of one block (layers.N.*) or one other module (the embedding, final
    norm, head): the units a streaming converter reads and maps at a time."""
    groups: list[list[str]] = []
    last = None
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" else ".".join(parts[:-1])
        if key != last:
            groups.append([])
            last = key
        groups[-1].append(name)
    return groups


def merge_tensor_parallel(shards: list[StateDict]) -> StateDict:
    """Join tp shards along each parameter's partition dim; replicated ones come from rank 0."""
    merged = {}
    for name, first in shards[0].items():
        dim = partition_dim(name)
        if dim is None or len(shards) == 1:
            merged[name] = first
        else:
            merged[name] = torch.cat([shard[name] for shard in shards], dim=dim)
    return merged


def check_state_dict(
    sd: StateDict,
    model: GPTNeoX,
    source: Path,
    described_by: str = "its config.yml",
    hint: str = "was config.yml edited after training?",
) -> None:
    """Raise CheckpointError unless `sd` has exactly the names and shapes of `model`."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in sd.items()}
    missing = sorted(expected.keys() - got.keys())
    extra = sorted(got.keys() - expected.keys())
    wrong = sorted(
        f"{k} {got[k]} != {expected[k]}"
        for k in expected.keys() & got.keys()
        if got[k] != expected[k]
    )
    if missing or extra or wrong:
        raise CheckpointError(
            f"the weights in {source} do not fit the model {described_by} describes: "
            f"missing {missing[:5]}, unexpected {extra[:5]}, wrong shapes {wrong[:5]}; {hint}"
        )


def read_checkpoint_config(tag_dir: Path) -> NeoXConfig:
    """The config.yml train.py saved in a global_stepN directory (its checksum checked)."""
    verify_files(tag_dir, [])
    try:
        return read_checkpoint_config_file(tag_dir / "config.yml")
    except ConfigError as e:
        text = str(e)
        if "is not a readable neox config" not in text:
            text = f"{tag_dir / 'config.yml'} is not a valid neox config: {text}"
        raise CheckpointError(text) from None


def training_dtype(cfg: NeoXConfig) -> torch.dtype:
    """The dtype a run with this config trained its weights in (the state by plain name keeps
    fp32 masters; the weights the model ran with are those rounded to it)."""
    from neox.config.derived import precision_of

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision_of(cfg), torch.float32)


def load_model_state(
    path: str | Path,
    iteration: Optional[int] = None,
    config: Optional[NeoXConfig] = None,
    trust: bool = False,
    allow_unverified: bool = False,
) -> tuple[NeoXConfig, StateDict]:
    """The checkpoint's saved config (or `config`) and its full plain-GPTNeoX state dict (padded
    vocabulary rows included), in the dtype training kept it (fp32 from ZeRO-3's partitions).

    `trust`: unpickle the files fully (they may run code), not weights-only.
    `allow_unverified`: read a neox checkpoint that lost its manifest (its files unchecked)."""
    tag_dir = resolve_checkpoint(path, iteration, allow_unverified=allow_unverified)
    cfg = config if config is not None else read_checkpoint_config(tag_dir)
    if read_reference(tag_dir) is not None:
        base, adapters = read_lora_checkpoint(tag_dir, cfg, trust)
        sd = merge_lora(base, adapters, cfg.lora)
    elif has_plain_state(tag_dir):  # every checkpoint train.py writes
        sd = plain_state_dict(tag_dir, trust, training_dtype(cfg))
    else:  # DeepSpeed's files: gpt-neox's, DeepSpeed's, the conversion tools', neox's before
        # state/
        tp = cfg.parallel.model_parallel_size
        sd = merge_tensor_parallel(read_shards(tag_dir, tp, cfg.model.num_layers, trust))
    if "embed_in.weight" not in sd:
        raise CheckpointError(f"{tag_dir} holds no embed_in.weight; it is not a neox checkpoint")
    padded_vocab = sd["embed_in.weight"].shape[0]
    check_state_dict(sd, build_model(cfg.model, padded_vocab, device="meta"), tag_dir)
    log.info("read %s: %d tensors, padded vocabulary %d", tag_dir, len(sd), padded_vocab)
    return cfg, sd


def read_lora_checkpoint(
    tag_dir: Path, cfg: NeoXConfig, trust: bool = False
) -> tuple[StateDict, StateDict]:
    """(the base's full state dict, the full adapter weights) of a LoRA run's checkpoint: the
    adapters from its files, the base from the checkpoint its lora_base.json names (checked
    against the manifest sha256 recorded there) or rebuilt from the recorded seed."""
    reference = read_reference(tag_dir)
    if reference is None:
        raise CheckpointError(f"{tag_dir} holds no LoRA adapter (no lora_base.json)")
    if problem := base_problem(tag_dir, reference):
        raise CheckpointError(problem)
    if has_plain_state(tag_dir):  # the trainable parameters: the adapters
        adapters = plain_state_dict(tag_dir, trust, training_dtype(cfg))
    else:
        tp = cfg.parallel.model_parallel_size
        adapters = merge_tensor_parallel(read_shards(tag_dir, tp, cfg.model.num_layers, trust))
    others = sorted(k for k in adapters if not is_adapter(k))
    if others or not adapters:
        raise CheckpointError(
            f"{tag_dir} has lora_base.json but its model files hold {len(adapters)} tensors, "
            f"not only LoRA adapters (e.g. {others[:3]}); was lora_base.json copied in by hand?"
        )
    if "base" in reference:
        _, base = load_model_state(reference["base"], trust=trust)
    else:
        rows = reference["padded_vocab_size"]
        base = build_model(cfg.model, rows, reference["init_seed"]).state_dict()
    log.info("read the adapters of %s and their base %s", tag_dir, reference.get("base", "(init)"))
    return base, adapters


def load_model(
    path: str | Path,
    iteration: Optional[int] = None,
    device: torch.device | str = "cpu",
    dtype: Optional[torch.dtype] = None,
    trust: bool = False,
    allow_unverified: bool = False,
) -> tuple[GPTNeoX, NeoXConfig]:
    """The checkpoint's plain GPTNeoX in eval mode on `device` (in `dtype`, default as saved)."""
    cfg, sd = load_model_state(path, iteration, trust=trust, allow_unverified=allow_unverified)
    model = build_model(cfg.model, sd["embed_in.weight"].shape[0], device="meta")
    model.load_state_dict(sd, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval(), cfg
