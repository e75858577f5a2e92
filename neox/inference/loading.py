"""The model generate.py runs: trained weights from `load`, on this rank's device, tp-sharded."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from neox.checkpoint.writer import VOCAB_MODULES, resize_vocab
from neox.config import ConfigError, NeoXConfig
from neox.model import build_model
from neox.parallel.topology import ProcessGroups

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def check_checkpoint_tokenizer(cfg: NeoXConfig) -> None:
    """ConfigError when cfg's tokenizer is not the one its checkpoint was trained with (unless
    allow_tokenizer_mismatch): its ids would decode to other text. deepy.py checks this before
    launch; this catches a one-process `python generate.py` or `python eval.py` run."""
    from neox.checkpoint.compat import checkpoint_tokenizer_problem

    if problem := checkpoint_tokenizer_problem(cfg):
        raise ConfigError(problem)


def load_state_dict(cfg: NeoXConfig) -> dict[str, torch.Tensor]:
    """The full (tp=1, pp=1) state dict of the checkpoint `load` (and `iteration`) name, from
    whatever layout trained it."""
    from neox.checkpoint.consolidate import CheckpointError, load_model_state

    if cfg.checkpoint.load is None:
        raise ConfigError("no trained weights: set `load` to the `save` directory of a run")
    try:
        c = cfg.checkpoint
        _, state = load_model_state(
            c.load,
            cfg.training.iteration,
            trust=c.trust_checkpoint_code,
            allow_unverified=c.allow_unverified_checkpoint,
        )
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return state


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
) -> tuple[nn.Module, Optional[Callable[[torch.Tensor], torch.Tensor]]]:
    """(model in eval mode, gather of vocab-split logits or None without tensor parallelism)
    with the trained weights. None, not an identity function, so that the Generator knows it
    may replay decode steps as CUDA graphs.

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
        return model, None
    return model, lambda logits: gather_from_tensor_parallel(logits, group)
