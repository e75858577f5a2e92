"""LAMBADA last-word prediction: accuracy and perplexity of the last word given the passage.

As lm-evaluation-harness's lambada_openai: the target is the last word with its leading space,
tokenized as the harness splits a context/continuation pair (`encode_pair`); a passage counts as correct when greedy decoding reproduces every
target token; perplexity is exp of the mean negative log-likelihood of the target per passage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from neox.inference.scoring import continuation_window, encode_pair, score_windows
from neox.tokenizer import Tokenizer


@dataclass
class LambadaSums:
    correct: int = 0
    nll: float = 0.0  # nats, summed over passages
    passages: int = 0

    def as_list(self) -> list[float]:
        return [self.correct, self.nll, self.passages]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> LambadaSums:
        correct, nll, passages = values
        return cls(round(correct), float(nll), round(passages))


def split_last_word(text: str) -> tuple[str, str]:
    """(context, " " + last word) of a passage, split at its last space."""
    context, sep, word = text.rpartition(" ")
    if not sep or not context or not word.strip():
        raise ValueError(f"LAMBADA passage has no last word after a space: {text[-80:]!r}")
    return context, " " + word


def score_lambada(
    model: nn.Module,
    tokenizer: Tokenizer,
    texts: Iterable[str],
    *,
    max_len: int,
    batch_size: int,
    device,
) -> LambadaSums:
    windows = [
        continuation_window(*encode_pair(tokenizer, *split_last_word(t)), max_len) for t in texts
    ]
    sums = LambadaSums()
    for score in score_windows(model, windows, batch_size, device):
        sums.correct += score.greedy
        sums.nll -= score.logprob
        sums.passages += 1
    return sums


def lambada_metrics(sums: LambadaSums) -> dict[str, float]:
    if sums.passages == 0:
        raise ValueError("no LAMBADA passages were scored")
    return {
        "accuracy": sums.correct / sums.passages,
        "perplexity": math.exp(sums.nll / sums.passages),
        "passages": sums.passages,
    }
