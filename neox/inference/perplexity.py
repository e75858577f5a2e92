"""Perplexity and bits per byte of documents, with a sliding window for long ones.

Each document is scored as lm-evaluation-harness scores a rolling log-likelihood: the EOD token
is the context of the first token, so every token of the text is predicted, and the sums are
over tokens (perplexity) and UTF-8 bytes of the text (bits per byte, tokenizer-independent).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from neox.inference.scoring import Window, rolling_windows, score_windows


@dataclass
class TextSums:
    """Sums over documents; ranks add theirs up before the ratios are taken."""

    nll: float = 0.0  # nats
    tokens: int = 0
    bytes: int = 0
    documents: int = 0

    def as_list(self) -> list[float]:
        return [self.nll, self.tokens, self.bytes, self.documents]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> TextSums:
        nll, tokens, nbytes, docs = values
        return cls(float(nll), round(tokens), round(nbytes), round(docs))


def bits_per_byte(nll: float, num_bytes: int) -> float:
    """Total negative log-likelihood in nats -> bits per UTF-8 byte of the text."""
    return nll / (num_bytes * math.log(2))


def text_metrics(sums: TextSums) -> dict[str, float]:
    """Perplexity (per token), bits per byte, and the counts they come from."""
    if sums.tokens == 0:
        raise ValueError("no tokens were scored: the documents are empty")
    return {
        "perplexity": math.exp(sums.nll / sums.tokens),
        "loss": sums.nll / sums.tokens,
        "bits_per_byte": bits_per_byte(sums.nll, sums.bytes),
        "tokens": sums.tokens,
        "bytes": sums.bytes,
        "documents": sums.documents,
    }


def score_texts(
    model: nn.Module,
    docs: Iterable[tuple[list[int], int]],
    *,
    eod: int,
    max_len: int,
    stride: int,
    batch_size: int,
    device,
) -> TextSums:
    """Sums over documents given as (token ids, UTF-8 byte count of their text)."""
    sums = TextSums()
    windows: list[Window] = []
    for ids, num_bytes in docs:
        if not ids:
            continue
        windows += rolling_windows([eod, *ids], max_len, stride)
        sums.tokens += len(ids)
        sums.bytes += num_bytes
        sums.documents += 1
        if len(windows) >= 16 * batch_size:  # bound memory, keep batches full
            sums.nll -= sum(s.logprob for s in score_windows(model, windows, batch_size, device))
            windows = []
    sums.nll -= sum(s.logprob for s in score_windows(model, windows, batch_size, device))
    return sums
