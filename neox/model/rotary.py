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

    Holds no parameters or buffers: the cos/sin table is built once per device and dtype, for
    `max_positions` positions, so the module survives meta-device construction and never enters
    a checkpoint. forward indexes the table with position_ids and never reads them on the host
    (a host read would stall the GPU once per layer); positions past the table are an error.
    """

    def __init__(self, dim: int, base: float, max_positions: int = 2048) -> None:
        super().__init__()
        self.dim = dim
        self.base = base
        self.max_positions = max_positions
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(
        self, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables of shape (n, dim), n >= length, cached per device and dtype."""
        length = max(length, self.max_positions)
        if torch.compiler.is_compiling():
            # A graph may read the table `prepare` built before compilation, but not cache one
            # (a side effect). Rebuilt inside the graph, the table fuses into the rotation as a
            # pow, cos and sin per element of q and k: 5% of a 1.4B step on an H100.
            table = self._cache.get((device, torch.float32))
            if table is not None and table[0].shape[0] >= length:
                return table[0].to(dtype), table[1].to(dtype)
            return self._table(length, device, dtype)
        cached = self._cache.get((device, dtype))
        if cached is None or cached[0].shape[0] < length:
            cached = self._cache[(device, dtype)] = self._table(length, device, dtype)
        return cached

    def prepare(self, device: torch.device) -> None:
        """Build the fp32 table on `device` for torch.compile'd forwards to read (any dtype)."""
        self.cos_sin(self.max_positions, device, torch.float32)

    def _table(
        self, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in fp32 whatever the model dtype: bf16 positions lose integers past 256.
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, device=device).float() / self.dim)
        )
        t = torch.arange(length, device=device).float()
        freqs = torch.outer(t, inv_freq)  # (n, dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (n, dim): same angle for both halves
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, position_ids: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (B, nh, T, hs) and k (B, nkv, T, hs); the last hs - dim features pass through.

        position_ids (B, T) or (T,), default 0..T-1, must stay below max(max_positions, T).
        """
        T = q.shape[-2]
        cos, sin = self.cos_sin(T, q.device, q.dtype)
        if position_ids is None:
            cos, sin = cos[:T], sin[:T]  # (T, dim), broadcast over B and heads
        else:
            # (B, 1, T, dim): a gather on the device, whatever the positions are.
            cos, sin = cos[position_ids].unsqueeze(-3), sin[position_ids].unsqueeze(-3)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., : self.dim], x[..., self.dim :]
        x_rot = x_rot * cos + rotate_half(x_rot) * sin
        return torch.cat((x_rot, x_pass), dim=-1)
