"""One transformer layer: pre-norm attention and MLP, sequential or parallel (GPT-J) residual."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from neox.config.model import ModelConfig
from neox.model.attention import Attention
from neox.model.mlp import MLP
from neox.model.moe import MoE
from neox.model.norms import build_norm

if TYPE_CHECKING:
    from neox.model.kv_cache import LayerKVCache


class Block(nn.Module):
    """Pre-norm transformer block; gpt_j_tied shares input_layernorm with the MLP branch."""

    def __init__(self, cfg: ModelConfig, layer_type: str = "global", moe: bool = False) -> None:
        super().__init__()
        self.parallel_residual = cfg.gpt_j_residual
        self.input_layernorm = build_norm(cfg)
        self.post_attention_layernorm = None if cfg.gpt_j_tied else build_norm(cfg)
        self.attention = Attention(cfg, layer_type)
        self.mlp = MoE(cfg) if moe else MLP(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[LayerKVCache] = None,
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C)."""
        drop = self.hidden_dropout
        ln1 = self.input_layernorm
        ln2 = ln1 if self.post_attention_layernorm is None else self.post_attention_layernorm
        if self.parallel_residual:
            # x + attn(ln1(x)) + mlp(ln2(x)): both branches read the same x (GPT-J, Pythia).
            h1 = ln1(x)
            h2 = h1 if ln2 is ln1 else ln2(x)
            attn = self.attention(h1, position_ids, attention_mask, kv_cache)
            return self.add_branches(x, drop(attn), drop(self.mlp(h2)))
        x = x + drop(self.attention(ln1(x), position_ids, attention_mask, kv_cache))
        return x + drop(self.mlp(ln2(x)))

    def add_branches(self, x: torch.Tensor, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        """The parallel residual's sum. Tensor parallelism replaces it on an instance whose
        branches return each rank's share of their outputs, to all-reduce both at once
        (neox/parallel/tensor.py)."""
        return x + attn + mlp
