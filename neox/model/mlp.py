"""Feed-forward block: plain (gelu/relu/silu) or gated (swiglu/geglu) MLP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from neox.config.model import ModelConfig


def activation_name(cfg: ModelConfig) -> str:
    """The elementwise function the MLP applies: gelu, gelu_tanh, relu or silu.

    gpt-neox's fused bias-GELU kernel is the tanh approximation, so `gelu` with
    bias_gelu_fusion=true means gelu_tanh here too: a gpt-neox config gives gpt-neox's numbers.
    """
    act = cfg.activation
    if act == "gelu" and cfg.bias_gelu_fusion:
        return "gelu_tanh"
    return {"swish": "silu", "swiglu": "silu", "geglu": "gelu"}.get(act, act)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def activation_act(cfg: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function activation_name names."""
    return _ACTIVATIONS[activation_name(cfg)]


class MLP(nn.Module):
    """h -> act(dense_h_to_4h(x)) -> h, or for gated MLPs act(gate(x)) * dense_h_to_4h(x) -> h."""

    def __init__(self, cfg: ModelConfig, ffn: Optional[int] = None) -> None:
        """ffn: the inner width (default the config's; MoE shared experts pass theirs)."""
        super().__init__()
        bias, shape = cfg.use_bias_in_mlp, cfg.shape
        h, ffn = cfg.hidden_size, ffn or shape.ffn_size
        self.act = activation_act(cfg)
        self.dense_h_to_4h = nn.Linear(h, ffn, bias=bias)
        self.gate = nn.Linear(h, ffn, bias=bias) if shape.gated_mlp else None
        self.dense_4h_to_h = nn.Linear(ffn, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C)."""
        if self.gate is not None:
            return self.dense_4h_to_h(self.act(self.gate(x)) * self.dense_h_to_4h(x))
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))
