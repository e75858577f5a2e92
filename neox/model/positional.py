"""ALiBi: per-head linear distance penalties added to attention scores (Press et al., 2021)."""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> list[float]:
    """The geometric slopes of ALiBi, 2^(-8/n), 2^(-16/n), ... for n heads.

    For a head count that is not a power of two, the closest smaller power of two gives the first
    slopes and every other slope of the next power of two fills the rest (the paper's recipe).
    """

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_2(num_heads)
    lower = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(lower) + alibi_slopes(2 * lower)[0::2][: num_heads - lower]


def alibi_bias(
    slopes: list[float], sq: int, sk: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Bias (nh, sq, sk): -slope * (distance from query to key); keys after the query get 0."""
    # Query i sits at absolute position i + (sk - sq), so a cached prefix lines up with the keys.
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    k_pos = torch.arange(sk, device=device).unsqueeze(0)
    distance = (q_pos - k_pos).clamp(min=0).to(torch.float32)  # (sq, sk)
    slope = torch.tensor(slopes, device=device, dtype=torch.float32).view(-1, 1, 1)
    return (-slope * distance).to(dtype)  # (nh, sq, sk)
