"""Next-token choice from logits: greedy, temperature, top-k, top-p; padded ids never chosen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    """gpt-neox's sampling keys: all three 0 is greedy; temperature 0 with top_k or top_p samples
    from the filtered logits unscaled (as gpt-neox does)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: off)")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in [0, 1] (0: off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and self.top_k == 0 and self.top_p == 0


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-inf on ids >= vocab_size: rows added to pad the vocabulary are no tokens."""
    if logits.shape[-1] > vocab_size:
        logits = logits.clone()
        logits[..., vocab_size:] = float("-inf")
    return logits


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th kept), -inf elsewhere."""
    kth = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely ids whose probability reaches p, -inf elsewhere."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop an id when the ids before it already reach p; the most likely id always stays.
    drop = (cumulative - sorted_logits.softmax(dim=-1)) >= p
    drop[..., 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    vocab_size: int,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Token ids (B,) from last-position logits (B, V); V may include padded rows.

    All on the device, no host sync, so decoding never waits for it (and greedy can run inside a
    CUDA graph). Sampling draws as torch.multinomial(probs, 1) does for one sample, minus its
    host-side validity check: the argmax of probs / Exp(1) noise, the same draws from the same
    generator, so the same ids.
    """
    if params.greedy:
        return logits[..., :vocab_size].argmax(dim=-1)
    logits = mask_padded_vocab(logits.float(), vocab_size)
    if params.temperature > 0:
        logits = logits / params.temperature
    if params.top_k:
        logits = filter_top_k(logits, params.top_k)
    if params.top_p:
        logits = filter_top_p(logits, params.top_p)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(dim=-1)
