import math

import pytest
import torch

from neox.training.optim import param_groups
from neox.training.schedule import LRSchedule


def test_warmup_starts_above_zero_and_reaches_peak():
    s = LRSchedule(peak_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=100, style="cosine")
    assert s.lr(0) == pytest.approx(0.1)
    assert s.lr(9) == pytest.approx(1.0)
    assert s.lr(10) == pytest.approx(1.0)


@pytest.mark.parametrize("style", ["linear", "cosine", "exponential"])
def test_decay_is_monotone_and_ends_at_min(style):
    s = LRSchedule(peak_lr=1.0, min_lr=0.05, warmup_iters=5, decay_iters=50, style=style)
    lrs = [s.lr(i) for i in range(5, 80)]
    assert all(a >= b - 1e-12 for a, b in zip(lrs, lrs[1:]))
    assert s.lr(50) == pytest.approx(
        0.05 if style != "exponential" else max(0.05, 0.05 + 0.95 * 0.1)
    )
    assert s.lr(1000) >= 0.05


def test_cosine_midpoint():
    s = LRSchedule(peak_lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=100, style="cosine")
    assert s.lr(50) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_constant_and_apply_sets_every_group():
    s = LRSchedule(peak_lr=0.3, min_lr=0.0, warmup_iters=0, decay_iters=10, style="constant")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1.0)
    assert s.apply(opt, 7) == pytest.approx(0.3)
    assert all(g["lr"] == pytest.approx(0.3) for g in opt.param_groups)


def test_biases_and_norms_are_not_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
