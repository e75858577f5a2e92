"""One decode step of the KV-cached model captured as a CUDA graph.

A decode step is a few hundred small kernels whose launch cost, at batch 1 or 16, exceeds their
run time. The static cache keeps every shape fixed, so the step can be captured once and
replayed per token: this step's token, positions and cache slot are copied into static input
buffers, and the `valid` mask of cached slots is the caller's buffer, updated in place.
"""

from __future__ import annotations

import torch
from torch import nn

from neox.inference.cache import KVCache


class GraphedDecode:
    """Callable (tok (B,), pos (B, 1), slot) -> logits (B, 1, V), replaying a captured step.

    The returned logits live in the graph's output buffer: use them before the next call.
    """

    def __init__(self, model: nn.Module, cache: KVCache, valid: torch.Tensor) -> None:
        B, S = valid.shape
        device = valid.device
        self.model, self.cache, self.valid = model, cache, valid
        self.tok = torch.zeros((B, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((B, 1), dtype=torch.long, device=device)
        # Warm-up and capture write slot S - 1, which no step has filled yet and which the step
        # that reaches it overwrites before reading; it stays masked until then.
        self.slot = torch.full((1,), S - 1, dtype=torch.long, device=device)
        cache.at(self.slot)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # allocations, rotary tables and kernel choices happen here
                self._step()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()

    def _step(self) -> torch.Tensor:
        mask = self.valid[:, None, None, :]  # (B, 1, 1, S): the cached slots a query may see
        return self.model(self.tok, self.pos, mask, kv_cache=self.cache)

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor, slot: int) -> torch.Tensor:
        self.tok.copy_(tok[:, None])
        self.pos.copy_(pos)
        self.slot.fill_(slot)
        self.graph.replay()
        return self.out
