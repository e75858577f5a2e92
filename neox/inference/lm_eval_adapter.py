"""lm-evaluation-harness on the neox model: an `LM` whose requests are scored by neox's windows.

Needs the optional `lm_eval` package (pip install neox[eval]). Requests are spread over the
data-parallel ranks by the harness itself (rank, world_size, all_gather, gather_object).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from lm_eval.api.model import LM
from torch import nn

from neox.inference.scoring import (
    continuation_window,
    encode_pair,
    rolling_windows,
    score_windows,
)
from neox.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class NeoXLM(LM):
    """lm_eval's LM interface (loglikelihood, loglikelihood_rolling, generate_until)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        max_len: int,
        batch_size: int = 8,
        device: torch.device | str = "cpu",
        max_gen_toks: int = 256,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.batch_size = batch_size
        self._device = torch.device(device)
        self.max_gen_toks = max_gen_toks
        self._rank = rank
        self._world_size = world_size

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        windows = [
            continuation_window(*encode_pair(self.tokenizer, *r.args), self.max_len)
            for r in requests
        ]
        scores = score_windows(self.model, windows, self.batch_size, self._device)
        return [(s.logprob, s.greedy) for s in scores]

    def loglikelihood_rolling(self, requests) -> list[float]:
        windows, owner = [], []
        for i, r in enumerate(requests):
            ids = [self.tokenizer.eod, *self.tokenizer.encode(r.args[0])]
            doc_windows = rolling_windows(ids, self.max_len, self.max_len)
            windows += doc_windows
            owner += [i] * len(doc_windows)
        totals = [0.0] * len(requests)
        for i, s in zip(owner, score_windows(self.model, windows, self.batch_size, self._device)):
            totals[i] += s.logprob
        return totals

    def generate_until(self, requests) -> list[str]:
        out = []
        for r in requests:
            context, gen_kwargs = r.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else [s for s in until if s]
            ids = self.tokenizer.encode(context) if context else [self.tokenizer.eod]
            new = greedy_generate(
                self.model,
                self.tokenizer,
                ids,
                max_new_tokens=gen_kwargs.get("max_gen_toks", self.max_gen_toks),
                max_len=self.max_len,
                until=until,
                device=self._device,
            )
            out.append(new)
        return out

    # Collectives the harness uses to spread requests over ranks and gather metrics.
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        parts = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, parts, dst=dst)
        return parts

    def barrier(self) -> None:
        dist.barrier()


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    tokenizer: Tokenizer,
    ids: list[int],
    *,
    max_new_tokens: int,
    max_len: int,
    until: list[str],
    device: torch.device | str = "cpu",
) -> str:
    """Greedy continuation of `ids` up to EOD, cut before the first stop string.

    A plain loop that re-reads the whole (left-truncated) sequence each step: no KV cache. The
    inference engine of neox/inference (branch `infer`) replaces it at merge.
    """
    seq = list(ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([seq[-max_len:]], device=device)
        # Padded vocabulary rows are no tokens: never pick one.
        token = int(model(window)[0, -1, : tokenizer.vocab_size].argmax())
        if token == tokenizer.eod:
            break
        seq.append(token)
        new.append(token)
        text = tokenizer.decode(new)
        if any(s in text for s in until):
            break
    text = tokenizer.decode(new)
    for s in until:
        text = text.split(s, 1)[0]
    return text


def run_lm_eval_tasks(
    model: nn.Module, tokenizer: Tokenizer, cfg, device, rank: int, world: int
) -> dict[str, Any]:
    """Run cfg.eval.eval_tasks through lm_eval.simple_evaluate; the metrics of each task."""
    import lm_eval

    e = cfg.eval
    lm = NeoXLM(
        model,
        tokenizer,
        max_len=model.cfg.seq_length,
        batch_size=e.eval_batch_size,
        device=device,
        rank=rank,
        world_size=world,
    )
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(e.eval_tasks),
        num_fewshot=e.eval_num_fewshot,
        limit=e.eval_limit,
        log_samples=False,
        bootstrap_iters=0,
    )
    return {} if out is None else out["results"]
