"""Rotary position embedding over the first rotary_pct of each head (GPT-NeoX rotate-half form)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim split in halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates the first `dim` features of q and k by angle position * base^(-2i/dim).

    Holds no parameters or buffers: cos/sin are recomputed on demand and cached per device and
    dtype, so the module survives meta-device construction and never enters a checkpoint.
    """

    def __init__(self, dim: int, base: float) -> None:
        super().__init__()
        self.dim = dim
        self.base = base
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(
        self, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables of shape (length, dim), cached and grown as needed."""
        cached = self._cache.get((device, dtype))
        if cached is not None and cached[0].shape[0] >= length:
            return cached[0][:length], cached[1][:length]
        # Angles in fp32 whatever the model dtype: bf16 positions lose integers past 256.
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, device=device).float() / self.dim)
        )
        t = torch.arange(length, device=device).float()
        freqs = torch.outer(t, inv_freq)  # (T, dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, dim): same angle for both halves
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self._cache[(device, dtype)] = (cos, sin)
        return cos, sin

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, position_ids: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (B, nh, T, hs) and k (B, nkv, T, hs); the last hs - dim features pass through."""
        T = q.shape[-2]
        length = T if position_ids is None else int(position_ids.max()) + 1
        cos, sin = self.cos_sin(length, q.device, q.dtype)
        if position_ids is None:
            cos, sin = cos[:T], sin[:T]  # (T, dim), broadcast over B and heads
        else:
            cos, sin = (
                cos[position_ids].unsqueeze(1),
                sin[position_ids].unsqueeze(1),
            )  # (B, 1, T, dim)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., : self.dim], x[..., self.dim :]
        x_rot = x_rot * cos + rotate_half(x_rot) * sin
        return torch.cat((x_rot, x_pass), dim=-1)
