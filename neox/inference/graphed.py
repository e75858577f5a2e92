"""One decode step captured as a CUDA graph.

A decode step is a few hundred small kernels whose launch cost, at batch 1 or 16, exceeds their
run time. The static cache keeps every shape fixed, so the step can be captured once and
replayed per token. The captured function reads and writes only buffers that outlive the graph
(the engine's DecodeState and KVCache): this step's token, position and cache slot are device
tensors the step itself advances, so a replay needs no host copy in, and with greedy decoding
the choice of the next token and its bookkeeping are captured too (one replay per token, no
logits handed back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CapturedStep:
    """Callable () -> what `step` returned at capture, replaying `step` as one CUDA graph.

    `scratch` puts the buffers into a state that warm-up may run from (warm-up executes the
    step: it writes the cache and advances counters); the caller resets them before replaying.
    Tensors returned live in the graph's memory: use them before the next call.
    """

    def __init__(
        self, step: Callable[[], Any], scratch: Callable[[], None], device: torch.device
    ) -> None:
        self.step = step
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # allocations, rotary tables and kernel choices happen here
                scratch()
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        scratch()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = step()

    def __call__(self) -> Any:
        self.graph.replay()
        return self.out
