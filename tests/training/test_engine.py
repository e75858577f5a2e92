"""The fused ZeRO overflow check gives DeepSpeed's own answer on the same gradients."""

from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from neox.training.deepspeed_engine import _has_overflow_partitioned_grads, any_non_finite

CASES = {
    "finite": {},
    "inf": {(0, 1): float("inf")},
    "minus_inf": {(1, 0): float("-inf")},
    "nan": {(1, 1): float("nan")},
    "nan_and_inf": {(0, 0): float("nan"), (1, 1): float("inf")},
}


def grads(poison: dict) -> dict[int, list]:
    g = torch.Generator().manual_seed(0)
    groups = {
        0: [torch.randn(5, 3, generator=g).bfloat16(), torch.randn(7, generator=g) * 1e30],
        1: [torch.randn(4, generator=g), torch.randn(2, 2, generator=g).bfloat16(), None],
    }
    for (i, j), value in poison.items():
        groups[i][j].view(-1)[1] = value
    return groups


@pytest.mark.parametrize("case", CASES)
def test_matches_deepspeed_serial_check(case):
    opt = SimpleNamespace(
        bit16_groups=[[], []],
        averaged_gradients=grads(CASES[case]),
        _has_inf_or_nan=DeepSpeedZeroOptimizer._has_inf_or_nan,
    )
    expected = DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(opt)
    got = _has_overflow_partitioned_grads(opt)
    assert got.shape == expected.shape == (1,) and got.dtype == torch.bool
    assert got.item() == expected.item() == (case != "finite")


def test_no_gradients_is_no_overflow():
    assert not any_non_finite([]).item()
