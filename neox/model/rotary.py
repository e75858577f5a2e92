"""Rotary position embedding over the first rotary_pct of each head (GPT-NeoX rotate-half form),
with transformers' RoPE scalings (linear, dynamic NTK, YaRN, Llama 3) computed as it does."""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from neox.config.shape import RopeScaling

# Tables shared by every layer with the same rotary settings (a 128k-position table is 130 MB in
# fp32; one per layer would be gigabytes), freed once no layer holds them.
_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim split in halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _exponents(dim: int, device: Optional[torch.device]) -> torch.Tensor:
    """2i / dim for i < dim / 2, in fp32: the exponent of the base in each frequency. Made on
    the device (no host copy, which a CUDA graph capturing a decode step would refuse)."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float) / dim


def inverse_frequencies(
    dim: int, base: float, rope: Optional[RopeScaling], device: Optional[torch.device] = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim/2,) in fp32, scale of cos and sin), in the order of operations of
    transformers' modeling_rope_utils, so the tables agree to the last bit. `dynamic` gives the
    frequencies of sequences no longer than max_positions (its base unchanged)."""
    kind = rope.rope_type if rope is not None else None
    if kind == "dynamic":
        # transformers computes this at init with seq_len = max_position_embeddings.
        f = rope.factor
        base = base * (
            (f * rope.original_max_positions / rope.original_max_positions) - (f - 1)
        ) ** (dim / (dim - 2))
    if kind == "yarn":
        return _yarn(dim, base, rope, device), rope.attention_factor
    inv_freq = 1.0 / (base ** _exponents(dim, device))
    if kind == "linear":
        inv_freq = inv_freq / rope.factor
    if kind == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, rope: RopeScaling) -> torch.Tensor:
    """Divide long wavelengths by the factor, keep short ones, interpolate between (Llama 3.1)."""
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old = rope.original_max_positions
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, rope: RopeScaling, device: Optional[torch.device]) -> torch.Tensor:
    """YaRN: interpolated frequencies below the correction range, original ones above, a linear
    ramp between (Peng et al., 2023)."""

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_positions
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp.to(device=device, dtype=torch.float)  # 1: the original frequency
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding(nn.Module):
    """Rotates the first `dim` features of q and k by angle position * inverse frequency.

    Holds no parameters or buffers: the cos/sin table is built once per device and dtype, for
    `max_positions` positions (shared by every layer with the same settings), so the module
    survives meta-device construction and never enters a checkpoint. forward indexes the table
    with position_ids and never reads them on the host (a host read would stall the GPU once per
    layer); positions past the table are an error, so a decoder extends it first (`prepare`).

    `dynamic` scaling recomputes the frequencies from each forward's largest position once it
    passes max_positions, as transformers does (cached keys keep the rotation they had).
    """

    def __init__(
        self,
        dim: int,
        base: float,
        max_positions: int = 2048,
        scaling: Optional[RopeScaling] = None,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.base = base
        self.max_positions = max_positions
        self.scaling = scaling
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
            cached = self._cache[(device, dtype)] = self._shared_table(length, device, dtype)
        return cached

    def prepare(
        self, device: torch.device, length: int = 0, dtype: torch.dtype = torch.float32
    ) -> None:
        """Build the table on `device` for at least `length` positions (default max_positions):
        fp32 for torch.compile'd forwards to read (any dtype), or `dtype` for eager decoding."""
        self.cos_sin(length, device, torch.float32)
        if dtype != torch.float32:
            self.cos_sin(length, device, dtype)

    def _shared_table(
        self, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.dim, float(self.base), self.scaling, length, device, dtype)
        cos, sin = _TABLES.get((*key, "cos")), _TABLES.get((*key, "sin"))
        if cos is None or sin is None:
            cos, sin = self._table(length, device, dtype)
            _TABLES[(*key, "cos")], _TABLES[(*key, "sin")] = cos, sin
        return cos, sin

    def _table(
        self, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in fp32 whatever the model dtype: bf16 positions lose integers past 256.
        inv_freq, scale = inverse_frequencies(self.dim, self.base, self.scaling, device)
        t = torch.arange(length, device=device).float()
        freqs = torch.outer(t, inv_freq)  # (n, dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (n, dim): same angle for both halves
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

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
        if self.scaling is not None and self.scaling.rope_type == "dynamic":
            cos, sin = self._dynamic(cos, sin, T, position_ids, q.device, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _dynamic(
        self,
        cos: torch.Tensor,
        sin: torch.Tensor,
        T: int,
        position_ids: Optional[torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic NTK: past max_positions, the base grows with the sequence (its largest
        position + 1), chosen on the device so a decode step never waits on the host."""
        orig = self.scaling.original_max_positions
        if position_ids is None:
            if T <= orig:
                return cos, sin
            position_ids = torch.arange(T, device=device)
        seq_len = position_ids.max() + 1
        # transformers' tensor path: fp32 from here, as its update on a longer sequence computes.
        seq = seq_len.clamp(min=orig)  # no host tensor: a CUDA graph may capture this
        f, dim = self.scaling.factor, self.dim
        base = self.base * ((f * seq / orig) - (f - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / (base ** _exponents(dim, device))
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, dim/2) or (T, dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 3:
            emb = emb.unsqueeze(-3)  # (B, 1, T, dim)
        longer = seq_len > orig
        return (
            torch.where(longer, emb.cos().to(dtype), cos),
            torch.where(longer, emb.sin().to(dtype), sin),
        )

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x_rot = x[..., : self.dim]
        x_rot = x_rot * cos + rotate_half(x_rot) * sin
        if not torch.compiler.is_compiling():
            return torch.cat((x_rot, x[..., self.dim :]), dim=-1)
        # The same values written elementwise: inductor lowers the cat of a computed part and a
        # passed-through part as two kernels (the pass-through copied on its own), an extra
        # ~1 us kernel for q and for k in every layer of a decode step.
        passed = x.shape[-1] - self.dim
        if passed == 0:
            return x_rot
        rotated = torch.arange(x.shape[-1], device=x.device) < self.dim
        return torch.where(rotated, F.pad(x_rot, (0, passed)), x)
