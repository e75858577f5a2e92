"""Write a full plain-GPTNeoX state dict as the DeepSpeed files a run at a chosen TP/PP loads.

The files are those train.py's engine.load reads with `finetune: true` (module
weights only; no optimizer state) for a run at ZeRO stage 0-2 (neox/checkpoint/ds_files.py):
at pp = 1 one module file per tp rank; at pp > 1 one file per pipeline layer and tp rank, plus
one module-less file per stage and tp rank (as DeepSpeed's pipeline engine writes them).
A `weights_only.txt` file marks the directory, so resuming from it without finetune is refused.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from neox.checkpoint.consolidate import CheckpointError, StateDict, partition_dim
from neox.checkpoint.ds_files import layer_file, mp_file
from neox.checkpoint.find import WEIGHTS_ONLY, tag_for
from neox.checkpoint.manifest import write_manifest
from neox.checkpoint.plain_state import copy_plain_state
from neox.config import NeoXConfig, load_dict, write_config
from neox.parallel.layers import shard
from neox.parallel.topology import Topology

log = logging.getLogger(__name__)


# The modules whose rows are the (padded) vocabulary.
VOCAB_MODULES = ("embed_in", "embed_out")


def resize_vocab(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Keep the first `rows` rows, or append zero rows up to `rows` (padded vocabulary)."""
    if weight.shape[0] >= rows:
        return weight[:rows]
    pad = weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])
    return torch.cat((weight, pad))


def with_layout(cfg: NeoXConfig, tp: int, pp: int, **keys: Any) -> NeoXConfig:
    """cfg at model_parallel_size=tp, pipe_parallel_size=pp (and any other flat `keys`)."""
    flat = cfg.to_flat()
    flat.update(model_parallel_size=tp, **keys)
    if pp != cfg.parallel.pp:
        flat["pipe_parallel_size"] = pp
    return load_dict(flat, source="re-laid-out checkpoint config")


def check_layout(cfg: NeoXConfig, tp: int, pp: int) -> None:
    """Raise CheckpointError when the model cannot be split into tp shards and pp stages."""
    try:
        Topology(tp=tp, pp=pp).check_model(cfg.model)
    except ValueError as e:
        raise CheckpointError(f"cannot write this model at the asked layout: {e}") from None


def resize_vocab_rows(sd: StateDict, rows: int) -> StateDict:
    """The state dict with its embedding (and untied head) cut or zero-padded to `rows` rows."""
    out = dict(sd)
    for module in VOCAB_MODULES:
        name = f"{module}.weight"
        if name in out:
            out[name] = resize_vocab(out[name], rows)
    return out


def shard_tensor_parallel(sd: StateDict, tp: int) -> list[StateDict]:
    """tp state dicts: each split parameter's rank-th slice (as the training layers take it)."""
    shards: list[StateDict] = [{} for _ in range(tp)]
    for name, tensor in sd.items():
        dim = partition_dim(name)
        for rank in range(tp):
            part = tensor if dim is None or tp == 1 else shard(tensor, dim, rank, tp)
            shards[rank][name] = part.clone()  # a view would save the full tensor's storage
    return shards


def pipeline_layers(sd: StateDict, num_layers: int) -> dict[int, StateDict]:
    """Pipeline layer index -> its modules' state dict (names relative to the layer)."""
    layers: dict[int, StateDict] = {}
    for name, tensor in sd.items():
        if name.startswith("layers."):
            block, rest = name[len("layers.") :].split(".", 1)
            layers.setdefault(int(block) + 1, {})[rest] = tensor
        elif name.startswith(("embed_in.", "embed_pos.")):
            layers.setdefault(0, {})[name] = tensor
        elif name.startswith("final_layer_norm."):
            layers.setdefault(num_layers + 1, {})[name] = tensor
        elif name.startswith("embed_out."):
            layers.setdefault(num_layers + 2, {})[name] = tensor
        else:
            raise ValueError(f"{name!r} belongs to no pipeline layer")
    return layers


def _engine_state(module: Optional[StateDict], mp_world: int, iteration: int) -> dict:
    return {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "lr_scheduler": None,
        "shared_params": {},
        "dp_world_size": 1,
        "mp_world_size": mp_world,
        "skipped_steps": 0,
        "global_steps": iteration,
        "global_samples": 0,
        "iteration": iteration,
    }


def write_checkpoint(
    sd: StateDict,
    cfg: NeoXConfig,
    save_dir: Path,
    iteration: int = 0,
    state_from: Optional[Path] = None,
) -> Path:
    """Write `sd` (full plain names, cfg's padded vocabulary rows) for cfg's TP/PP into
    save_dir/global_step{iteration}, with config.yml there and beside it, and `latest`.
    `state_from`: a checkpoint whose training state by plain name (optimizer included) goes
    along, so the result resumes; without it the result holds weights only."""
    tp, pp = cfg.parallel.model_parallel_size, cfg.parallel.pp
    save_dir = Path(save_dir)
    tag_dir = save_dir / tag_for(iteration)
    tag_dir.mkdir(parents=True, exist_ok=True)
    shards = shard_tensor_parallel(sd, tp)
    if pp == 1:
        for rank, module in enumerate(shards):
            state = _engine_state(module, tp, iteration)
            torch.save(state, tag_dir / mp_file(rank))
    else:
        for rank, module in enumerate(shards):
            for index, layer in pipeline_layers(module, cfg.model.num_layers).items():
                torch.save(layer, tag_dir / layer_file(index, rank))
        for rank in range(pp * tp):
            state = _engine_state(None, pp * tp, iteration)
            torch.save(state, tag_dir / mp_file(rank))
    if state_from is not None:
        copy_plain_state(state_from, tag_dir)
    else:
        (tag_dir / WEIGHTS_ONLY).write_text(
            "Model weights only (no optimizer state): start a run from them with "
            "`finetune: true`.\n"
        )
    write_config(cfg, tag_dir / "config.yml")
    write_manifest(
        tag_dir, iteration, sd["embed_in.weight"].shape[0] if "embed_in.weight" in sd else None
    )
    write_config(cfg, save_dir / "config.yml")
    (save_dir / "latest").write_text(tag_for(iteration))
    log.info("wrote %s at tp=%d pp=%d", tag_dir, tp, pp)
    return tag_dir
