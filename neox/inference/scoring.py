"""Log-likelihood of target tokens under the model, in windows of at most max_len inputs.

A `Window` is a slice of a token sequence: the model reads `tokens[:-1]` and is scored on
predicting the last `num_targets` tokens. Long documents become several windows
(`rolling_windows`), a context + continuation pair one (`continuation_window`); `score_windows`
runs any list of them in padded batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from neox.tokenizer import Tokenizer


@dataclass(frozen=True)
class Window:
    """tokens[:-1] go in; the last num_targets tokens of `tokens` are scored."""

    tokens: tuple[int, ...]
    num_targets: int


@dataclass(frozen=True)
class WindowScore:
    logprob: float  # sum of log p(target) in nats
    num_targets: int
    greedy: bool  # every target is the argmax of its logits


def rolling_windows(tokens: Sequence[int], max_len: int, stride: int) -> list[Window]:
    """Windows that score tokens[1:] exactly once each (tokens[0] is context only, e.g. EOD).

    The first window scores up to max_len tokens from the start; each later one scores the next
    `stride` tokens with the max_len - stride (or more) tokens before them as context. A sequence
    of at most max_len + 1 tokens is one window: the plain full-context score.
    """
    if not 1 <= stride <= max_len:
        raise ValueError(f"stride={stride} must be between 1 and max_len={max_len}")
    windows = []
    first = 1  # first target position of the next window
    while first < len(tokens):
        end = min(len(tokens), first + (stride if windows else max_len))
        start = max(0, end - 1 - max_len)  # the model reads tokens[start:end-1]
        windows.append(Window(tuple(tokens[start:end]), end - first))
        first = end
    return windows


def continuation_window(
    context: Sequence[int], continuation: Sequence[int], max_len: int
) -> Window:
    """The continuation scored after as much of the context as fits (left-truncated)."""
    if not continuation:
        raise ValueError("continuation has no tokens")
    if not context:
        raise ValueError("context has no tokens; start it with the EOD token")
    if len(continuation) > max_len:
        raise ValueError(
            f"continuation of {len(continuation)} tokens does not fit the context of {max_len}"
        )
    tokens = (list(context) + list(continuation))[-(max_len + 1) :]
    return Window(tuple(tokens), len(continuation))


def encode_pair(
    tokenizer: Tokenizer, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness splits them.

    The pair is tokenized as one string and cut where the context's own tokens end, so the
    continuation's tokens are those the model would see in running text; spaces that end the
    context move to the continuation; an empty context is the EOD token.
    """
    if not context:
        return [tokenizer.eod], tokenizer.encode(continuation)
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx) :]


# Scored positions per float32 log-softmax: at long context one copy of them all would not fit
# (128k tokens x a 50k vocabulary is 26 GB), while 4096 rows are 0.8 GB.
SCORE_ROWS = 4096


@torch.no_grad()
def score_windows(
    model: nn.Module,
    windows: Sequence[Window],
    batch_size: int,
    device: torch.device | str,
    rows: int = SCORE_ROWS,
) -> list[WindowScore]:
    """Score every window; batches are padded on the right (causal: padding is never seen).
    The log-softmax runs over `rows` scored positions at a time."""
    # Longest first, so each batch pads little; results go back in the caller's order.
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].tokens))
    scores: list[WindowScore | None] = [None] * len(windows)
    for b in range(0, len(order), batch_size):
        batch = [windows[i] for i in order[b : b + batch_size]]
        width = max(len(w.tokens) for w in batch) - 1
        inputs = torch.zeros(len(batch), width, dtype=torch.long)
        for row, w in enumerate(batch):
            inputs[row, : len(w.tokens) - 1] = torch.tensor(w.tokens[:-1])
        logits = model(inputs.to(device))  # (B, T, V)
        for row, w in enumerate(batch):
            n = len(w.tokens) - 1
            targets = torch.tensor(w.tokens[-w.num_targets :], device=logits.device)
            logprob = torch.zeros((), dtype=torch.float64, device=logits.device)
            greedy = torch.ones((), dtype=torch.bool, device=logits.device)
            first = n - w.num_targets
            for start in range(0, w.num_targets, rows):
                # Softmax in float32 over scored positions only: no (B, T, V) float32 copy.
                z = logits[row, first + start : first + min(start + rows, w.num_targets)]
                lp = F.log_softmax(z.float(), dim=-1)  # (k, V)
                t = targets[start : start + rows]
                logprob += lp.gather(-1, t[:, None]).squeeze(-1).double().sum()
                greedy &= (lp.argmax(-1) == t).all()
            scores[order[b + row]] = WindowScore(logprob.item(), w.num_targets, bool(greedy))
    return scores  # type: ignore[return-value]
