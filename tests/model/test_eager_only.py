"""eager_only (neox/model/eager.py): a function run eagerly even inside a compiled graph (the late
block mask, the context-parallel exchange), without importing the compiler up front."""

import torch

from neox.model import attention
from neox.model.eager import eager_only


def test_the_late_block_mask_runs_outside_the_compiled_graph():
    seen = []
    real = attention._late_block_mask.__wrapped__

    @eager_only
    def spy(*args):
        seen.append(torch.compiler.is_compiling())  # True only where dynamo traces it
        return real(*args)

    def step(x):
        mask = spy(None, 8, None, x.device)
        return x * 2, mask

    compiled = torch.compile(step, backend="eager")
    for _ in range(2):
        y, mask = compiled(torch.ones(3))
        assert torch.equal(y, torch.full((3,), 2.0)) and mask is not None
    assert seen == [False, False]
