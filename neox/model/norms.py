"""Normalisation layers: LayerNorm, RMSNorm, ScaleNorm, and build_norm choosing one from the config."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neox.config.model import ModelConfig


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (already a fused kernel), with the bias switchable."""

    def __init__(self, dim: int, eps: float, bias: bool = True) -> None:
        super().__init__(dim, eps=eps, bias=bias)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 (eps inside the root, as Llama)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the scale, so bf16 runs match HF Llama bit for bit.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


class ScaleNorm(nn.Module):
    """x / max(||x||, eps) * g with one learned scalar g (Nguyen & Salazar, 2019)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=self.eps)
        return x / norm * self.weight


def build_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The norm cfg.norm names, over `dim` features (default hidden_size)."""
    dim = cfg.hidden_size if dim is None else dim
    if cfg.norm == "layernorm":
        return LayerNorm(dim, cfg.layernorm_epsilon, bias=cfg.use_bias_in_norms)
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.rms_norm_epsilon)
    if cfg.norm == "scalenorm":
        return ScaleNorm(dim, cfg.scalenorm_epsilon)
    raise ValueError(f"unknown norm {cfg.norm!r}; use layernorm, rmsnorm or scalenorm")
