"""lm-evaluation-harness on the neox model: an `LM` whose requests are scored by neox's windows.

Needs the optional `lm_eval` package (pip install neox[eval]). Requests are spread over the
data-parallel ranks by the harness itself (rank, world_size, all_gather, gather_object).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lm_eval.api.model import LM
from torch import nn

from neox.inference.generator import Generator
from neox.inference.scoring import (
    continuation_window,
    encode_pair,
    rolling_windows,
    score_windows,
)
from neox.model.kv_cache import KVCache
from neox.tokenizer import Tokenizer


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
        """Greedy continuations (KV-cached where the model allows), cut before a stop string."""
        eod = self.tokenizer.eod
        generator = Generator(
            self.model,
            self.tokenizer.vocab_size,
            eod,
            use_cache=KVCache.supports(self.model) is None,
        )
        out = []
        for r in requests:
            context, gen_kwargs = r.args
            until = (gen_kwargs or {}).get("until") or []
            until = [until] if isinstance(until, str) else [u for u in until if u]
            max_new = min(
                (gen_kwargs or {}).get("max_gen_toks", self.max_gen_toks), self.max_len - 1
            )
            # Keep the end of a long context: prompt and continuation fit max_len positions.
            ids = (self.tokenizer.encode(context) if context else [eod])[
                -(self.max_len - max_new) :
            ]
            (completion,) = generator.generate([ids], max_new)
            text = self.tokenizer.decode(completion.tokens)
            for stop in until:
                text = text.split(stop, 1)[0]
            out.append(text)
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


def run_lm_eval_tasks(
    model: nn.Module, tokenizer: Tokenizer, cfg, device, rank: int, world: int
) -> dict[str, Any]:
    """Run cfg.eval.eval_tasks through lm_eval.simple_evaluate; the metrics of each task."""
    import lm_eval

    from neox.plan.preflight import lm_eval_task_manager

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
        task_manager=lm_eval_task_manager(list(e.eval_tasks), e.eval_include_path),
    )
    return {} if out is None else out["results"]
