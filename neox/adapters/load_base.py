"""A LoRA run's base: read from `lora_base` into this rank's (tensor-parallel) model."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from neox.adapters.base_record import base_reference
from neox.checkpoint.consolidate import load_model_state, lora_base_dir
from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.writer import resize_vocab_rows, shard_tensor_parallel
from neox.config import NeoXConfig

log = logging.getLogger(__name__)


@torch.no_grad()
def load_lora_base(
    model: nn.Module, cfg: NeoXConfig, groups: Any, padded_vocab_size: int
) -> dict[str, Any]:
    """Copy the base's weights (any layout: consolidated, then this tp rank's shard taken)
    into `model` before its adapters are added; returns the reference checkpoints record.
    Without lora_base the model keeps the weights it was initialised with."""
    tag_dir = lora_base_dir(cfg)
    reference = base_reference(cfg, tag_dir, padded_vocab_size)
    if tag_dir is None:
        return reference
    c = cfg.checkpoint
    _, sd = load_model_state(
        tag_dir, trust=c.trust_checkpoint_code, allow_unverified=c.allow_unverified_checkpoint
    )
    sd = resize_vocab_rows(sd, padded_vocab_size)
    tp = groups.get_tensor_model_parallel_world_size()
    mine = shard_tensor_parallel(sd, tp)[groups.get_tensor_model_parallel_rank()]
    own = model.state_dict()
    wrong = sorted(k for k in own if k in mine and own[k].shape != mine[k].shape)
    if own.keys() != mine.keys() or wrong:
        missing = sorted(own.keys() - mine.keys())[:5]
        raise CheckpointError(
            f"lora_base {tag_dir} does not fit this config's model: missing {missing}, wrong "
            f"shapes {wrong[:5]}; train the adapter with the base's model config"
        )
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in mine.items()}, strict=True)
    log.info("loaded the LoRA base %s", tag_dir)
    return reference
