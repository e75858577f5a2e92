"""A block mask built late (no DocumentMask handed in) runs eagerly even inside a compiled graph,
without the model module importing the compiler up front."""

import torch

from neox.model import attention


def test_the_late_block_mask_runs_outside_the_compiled_graph(monkeypatch):
    seen = []
    real = attention._late_block_mask_eager

    def spy(*args):
        seen.append(torch.compiler.is_compiling())  # True only where dynamo traces it
        return real(*args)

    monkeypatch.setattr(attention, "_late_block_mask_eager", spy)

    def step(x):
        mask = attention._late_block_mask(None, 8, None, x.device)
        return x * 2, mask

    compiled = torch.compile(step, backend="eager")
    for _ in range(2):
        y, mask = compiled(torch.ones(3))
        assert torch.equal(y, torch.full((3,), 2.0)) and mask is not None
    assert seen == [False, False]
