"""The plain GPT-NeoX-family model: no torch.distributed, built from a ModelConfig."""

from __future__ import annotations

from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from neox.config.model import ModelConfig
from neox.model.gpt import GPTNeoX
from neox.model.init import init_parameter
from neox.model.loss import lm_loss
from neox.plan.estimate import count_parameters

__all__ = ["GPTNeoX", "build_model", "count_parameters", "init_parameter", "lm_loss"]


def build_model(
    cfg: ModelConfig,
    vocab_size: int,
    seed: int = 1234,
    device: Optional[torch.device | str] = None,
) -> GPTNeoX:
    """A GPTNeoX on `device` (default CPU), initialised from `seed`.

    device="meta" allocates nothing and initialises nothing: shard first, then materialise with
    `model.to_empty(device=...)` and `model.reset_parameters(seed)`.
    """
    device = torch.device("cpu" if device is None else device)
    # Build on meta so nn.Linear's own init (thrown away below) costs no time or memory.
    with torch.device("meta"), _NoNormalOnMeta():
        model = GPTNeoX(cfg, vocab_size)
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    model.reset_parameters(seed)
    return model


class _NoNormalOnMeta(TorchFunctionMode):
    """Skips normal_ on meta tensors (nn.Embedding's own init): they hold no values, and the meta
    kernel imports torch._dynamo, seconds that generate.py and eval.py would wait for on every
    rank (neox/model/eager.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.init.normal_, torch.Tensor.normal_):
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)
