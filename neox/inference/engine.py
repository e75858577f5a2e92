"""Batched autoregressive generation: left-padded prompts, static KV cache or full recompute."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from neox.inference.cache import KVCache
from neox.inference.graphed import GraphedDecode
from neox.inference.sampling import SamplingParams, sample


@dataclass
class Completion:
    """One prompt's continuation."""

    tokens: list[int]
    """Generated ids, without the end-of-document id that ended them."""
    finished: bool
    """True when the end-of-document token ended the sequence (not the token budget)."""
    logits: Optional[list[float]] = None
    """The raw logit of each generated token (return_logits)."""


def left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, L), mask (B, L) True on real tokens): prompts right-aligned, so every row's next
    token goes to the same slot L."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (use [eod] for no context)")
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, L - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, L - len(p) :] = True
    return ids.to(device), mask.to(device)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, L) counting real tokens only; left padding gets 0 (it is masked)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class Generator:
    """Generates continuations for batches of token-id prompts with one model.

    Args:
        gather_logits: maps this rank's last-position logits (B, V/tp) to the full (B, V);
            the identity without tensor parallelism.
        use_cache: decode with the static KV cache; False recomputes the whole sequence each
            step (gpt-neox's `recompute`), which gives the same greedy tokens.
    """

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        eod: int,
        use_cache: bool = True,
        gather_logits: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        cuda_graphs: bool = True,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.eod = eod
        unsupported = KVCache.supports(model) if use_cache else None
        if unsupported:
            raise ValueError(
                f"the KV cache does not support {unsupported}; set `recompute: true` to "
                "generate by recomputing the whole sequence each token"
            )
        self.use_cache = use_cache
        self.gather_logits = gather_logits or (lambda x: x)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # Replay each decode step as one CUDA graph (neox.inference.graphed); not with tensor
        # parallelism (gather_logits), whose collectives stay outside graphs here.
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and gather_logits is None

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        generator: Optional[torch.Generator] = None,
        return_logits: bool = False,
    ) -> list[Completion]:
        """Up to max_new_tokens for each prompt; a row stops at the end-of-document token."""
        ids, mask = left_pad(prompts, self.eod, self.device)
        B = ids.shape[0]
        tokens = torch.full((B, max_new_tokens), self.eod, dtype=torch.long, device=self.device)
        chosen_logits = torch.zeros((B, max_new_tokens), device=self.device)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        steps = self._cached_steps if self.use_cache else self._recomputed_steps
        step = steps(ids, mask, max_new_tokens)
        logits = next(step)
        n = 0
        while n < max_new_tokens:
            logits = self.gather_logits(logits).float()  # (B, V)
            tok = sample(logits, params, self.vocab_size, generator)
            tok = torch.where(finished, self.eod, tok)
            tokens[:, n] = tok
            if return_logits:
                chosen_logits[:, n] = logits.gather(-1, tok[:, None]).squeeze(-1)
            finished |= tok == self.eod
            n += 1
            # The one host sync per token: stop once every row has ended.
            if n == max_new_tokens or bool(finished.all()):
                break
            logits = step.send(tok)
        step.close()
        return self._completions(tokens[:, :n], chosen_logits[:, :n], return_logits)

    def _cached_steps(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int):
        """Yields last-position logits (B, V); is sent each step's tokens (B,)."""
        B, L = ids.shape
        S = L + max_new_tokens
        cache = KVCache(self.model, B, S, self.dtype, self.device)
        slots = torch.arange(S, device=self.device)
        valid = torch.zeros((B, S), dtype=torch.bool, device=self.device)
        valid[:, :L] = mask
        # Prefill: slot i sees slots j <= i holding real tokens (and itself, so padding rows
        # stay finite).
        causal = slots[None, :] <= slots[:L, None]  # (L, S)
        allowed = causal & (valid[:, None, :] | (slots[None, :] == slots[:L, None]))  # (B, L, S)
        pos = positions(mask)
        logits = self.model(ids, pos, allowed[:, None], kv_cache=cache.at(slots[:L]))
        next_pos = pos[:, -1:] + 1  # (B, 1)
        graphed = GraphedDecode(self.model, cache, valid) if self.cuda_graphs and S > L else None
        for slot in range(L, S):
            tok = yield logits[:, -1]
            valid[:, slot] = True
            if graphed is not None:
                logits = graphed(tok, next_pos, slot)
            else:
                logits = self.model(
                    tok[:, None],
                    next_pos,
                    valid[:, None, None, :],
                    kv_cache=cache.at(slots[slot : slot + 1]),
                )
            next_pos = next_pos + 1
        yield logits[:, -1]

    def _recomputed_steps(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int):
        """The whole sequence through the model each step: no cache, any position scheme."""
        while True:
            logits = self.model(ids, positions(mask), mask)
            tok = yield logits[:, -1]
            ids = torch.cat((ids, tok[:, None]), dim=1)
            mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), dim=1)

    def _completions(
        self, tokens: torch.Tensor, logits: torch.Tensor, return_logits: bool
    ) -> list[Completion]:
        out = []
        for row, row_logits in zip(tokens.tolist(), logits.tolist()):
            end = row.index(self.eod) if self.eod in row else len(row)
            out.append(
                Completion(
                    tokens=row[:end],
                    finished=end < len(row),
                    logits=row_logits[:end] if return_logits else None,
                )
            )
        return out
