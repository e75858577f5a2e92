"""The model generate.py runs: trained weights from `load`, on this rank's device, tp-sharded."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from neox.checkpoint.hf_map import VOCAB_MODULES, resize_vocab
from neox.config import ConfigError, NeoXConfig
from neox.config.preflight import checkpoint_tag
from neox.model import build_model
from neox.parallel.topology import ProcessGroups

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def load_state_dict(cfg: NeoXConfig) -> dict[str, torch.Tensor]:
    """The full (tp=1, pp=1) state dict of the checkpoint the config names (`load`, `iteration`)."""
    c = cfg.checkpoint
    tag = checkpoint_tag(c.load, cfg.training.iteration)
    try:
        from neox.checkpoint.consolidate import load_model_state
    except ImportError:
        return _read_single_rank(Path(c.load) / tag)
    _, state = load_model_state(c.load, int(tag.removeprefix("global_step")))
    return state


def _read_single_rank(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint one model-parallel rank wrote (tp=1, pp=1)."""
    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if len(files) != 1 or any(tag_dir.glob("layer_*-model_states.pt")):
        raise ConfigError(
            f"{tag_dir} was written by a tensor- or pipeline-parallel run; reading it needs "
            "neox.checkpoint.consolidate (branch export)"
        )
    state = torch.load(files[0], map_location="cpu", weights_only=False)
    return state["module"]


def generation_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The training precision on GPUs; fp32 on CPU, where half-precision matmuls are slow."""
    return DTYPES[precision] if device.type != "cpu" else torch.float32


def build_generation_model(
    cfg: NeoXConfig,
    padded_vocab_size: int,
    groups: ProcessGroups,
    device: torch.device,
    dtype: torch.dtype,
    state: Optional[dict[str, torch.Tensor]] = None,
) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """(model in eval mode, gather of vocab-split logits) with the trained weights.

    The padded vocabulary of this layout may differ from the training one's (it is a multiple
    of model_parallel_size): embedding rows are cut or zero-padded to fit; padded ids are never
    sampled.
    """
    from neox.parallel.mappings import gather_from_tensor_parallel
    from neox.parallel.tensor import apply_tensor_parallel

    state = load_state_dict(cfg) if state is None else state
    state = {
        k: resize_vocab(v, padded_vocab_size) if k.split(".")[0] in VOCAB_MODULES else v
        for k, v in state.items()
    }
    model = build_model(cfg.model, padded_vocab_size, device="meta")
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        raise ConfigError(
            f"the checkpoint in load={cfg.checkpoint.load!r} does not fit this model config: "
            f"{str(e).splitlines()[-1].strip()}; pass the config it was trained with (a copy is "
            "saved beside it as config.yml)"
        ) from None
    model = model.to(device=device, dtype=dtype).eval()
    apply_tensor_parallel(model, groups, cfg.model, copy_weights=True)
    group = groups.tensor
    if groups.get_tensor_model_parallel_world_size() == 1:
        return model, lambda logits: logits
    return model, lambda logits: gather_from_tensor_parallel(logits, group)
