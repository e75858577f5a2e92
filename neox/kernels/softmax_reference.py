"""Plain torch scale + mask + softmax: the numbers the fused Triton kernel must reproduce."""

from __future__ import annotations

from typing import Optional

import torch


def causal_mask(sq: int, sk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool [sq, sk] mask, True where key j lies after query i, i.e. j > i + (sk - sq)."""
    # The offset aligns the last query with the last key, so Sq < Sk (decoding with a cache)
    # lets query i see the whole cache plus its own position.
    rows = torch.arange(sq, device=device).unsqueeze(1)
    cols = torch.arange(sk, device=device).unsqueeze(0)
    return cols > rows + (sk - sq)


def scaled_masked_softmax_reference(
    scores: torch.Tensor,
    scale: float,
    causal: bool,
    padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """softmax(scale * scores) over the last dim with masked positions at probability 0.

    Math is done in float32 (float64 for float64 input) and the result is cast back to the input
    dtype. A row whose every position is masked comes out as zeros rather than NaN.

    Args:
        scores: [..., Sq, Sk] attention scores.
        scale: multiplier applied before the softmax (usually 1/sqrt(head_dim)).
        causal: mask key j > query i + (Sk - Sq).
        padding_mask: bool tensor broadcastable to ``scores``; True marks a masked-out position.
    """
    if scores.dim() < 2:
        raise ValueError(
            f"scores must have at least 2 dims [..., Sq, Sk], got shape {tuple(scores.shape)}"
        )
    compute_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    x = scores.to(compute_dtype) * scale
    sq, sk = scores.shape[-2:]
    masked = torch.zeros((), dtype=torch.bool, device=scores.device)
    if causal:
        masked = causal_mask(sq, sk, scores.device)
    if padding_mask is not None:
        masked = masked | padding_mask.to(device=scores.device, dtype=torch.bool)
    x = x.masked_fill(masked, float("-inf"))
    # The row max only shifts the exponent for stability (softmax does not depend on it), so it
    # is detached; a fully masked row has max -inf, replaced by 0 so that exp gives 0, not NaN.
    row_max = x.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(x - row_max)
    total = e.sum(dim=-1, keepdim=True)
    probs = e / torch.where(total > 0, total, torch.ones_like(total))
    return probs.to(scores.dtype)
