"""The Triton kernels, run on CPU by Triton's interpreter, against a float64 reference.

Not collected by default: Triton's interpreter only works when TRITON_INTERPRET=1 is set before
triton is imported, so test_fused_softmax.py runs this file in a fresh process with it set. To run
it alone: TRITON_INTERPRET=1 python -m pytest tests/kernels/softmax_interpreter_helpers.py
Triton's interpreter is slow, so the shapes are tiny; a forced small ``block_size`` makes short
rows take the multi-block (two-pass) path that long rows take on a GPU.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "softmax_interpreter_helpers.py needs TRITON_INTERPRET=1 set before triton is imported; "
        "run it through tests/kernels/test_fused_softmax.py or with the variable exported"
    )

import torch  # noqa: E402

# Imported only after the check above, so triton starts in interpreter mode.
import triton  # noqa: E402, F401

from neox.kernels import fused_softmax  # noqa: E402
from neox.kernels.fused_softmax import (  # noqa: E402
    KernelConfig,
    scaled_masked_softmax,
    triton_available,
)
from neox.kernels.softmax_reference import scaled_masked_softmax_reference
from tests.kernels.softmax_helpers import check_against_float64  # noqa: E402

# Max error allowed, per input dtype: (probs rtol, probs atol, grad error / max |grad|).
# fp32 is limited by float32 rounding; fp16/bf16 by rounding the stored probs to 11/8 bits.


def make_padding_mask(kind: str, b: int, h: int, sq: int, sk: int):
    """None, per-batch key padding [B, 1, 1, Sk], or a full [B, H, Sq, Sk] random mask."""
    if kind == "none":
        return None
    if kind == "keys":
        mask = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
        mask[0, ..., sk // 2 :] = True  # batch 0 is a shorter, right-padded sequence
        return mask
    return torch.rand(b, h, sq, sk) < 0.3


# (B, H, Sq, Sk, causal, padding, block_size): odd sizes, Sq < Sk (decoding with a cache),
# Sq > Sk, and rows longer than the block so the two-pass loop runs.
CASES = [
    (2, 3, 7, 7, True, "none", None),
    (2, 2, 5, 13, True, "keys", None),
    (1, 2, 9, 6, True, "random", None),
    (2, 1, 4, 11, False, "random", None),
    (1, 2, 6, 37, True, "keys", 16),
    (2, 1, 3, 29, False, "random", 8),
]


@pytest.mark.parametrize("b,h,sq,sk,causal,padding,block_size", CASES)
def test_float32_matches_float64_reference(b, h, sq, sk, causal, padding, block_size):
    torch.manual_seed(sq * 100 + sk)
    scores = 3 * torch.randn(b, h, sq, sk)
    mask = make_padding_mask(padding, b, h, sq, sk)
    check_against_float64(scores, 0.6, causal, mask, block_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [None, 8])
def test_half_precision_matches_float64_reference(dtype, block_size):
    torch.manual_seed(7)
    scores = (4 * torch.randn(2, 2, 5, 19)).to(dtype)
    mask = make_padding_mask("keys", 2, 2, 5, 19)
    check_against_float64(scores, 0.5, True, mask, block_size)


# Row lengths that are whole 16-byte vectors (loads rounded up past the causal bound), several
# rows per program with a partial last program, and both with the two-pass loop.
VECTOR_CASES = [
    (torch.float32, 2, 3, 5, 16, None, KernelConfig(rows=4, num_warps=1)),
    (torch.bfloat16, 1, 3, 7, 24, None, KernelConfig(rows=2, num_warps=2)),
    (torch.float16, 2, 1, 9, 40, 16, KernelConfig(rows=4, num_warps=1)),
    (torch.float32, 1, 2, 24, 24, 8, KernelConfig(rows=2, num_warps=1)),
]


@pytest.mark.parametrize("dtype,b,h,sq,sk,block_size,config", VECTOR_CASES)
@pytest.mark.parametrize("padding", ["none", "keys"])
def test_vector_loads_and_row_groups_match_float64_reference(
    dtype, b, h, sq, sk, block_size, config, padding
):
    torch.manual_seed(sq * 10 + sk)
    # NaN past the causal bound: the rounded-up loads read it, and it must not leak.
    scores = 3 * torch.randn(b, h, sq, sk)
    scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), torch.nan)
    mask = make_padding_mask(padding, b, h, sq, sk)
    probs = check_against_float64(scores.to(dtype), 0.6, True, mask, block_size, config)
    assert not torch.isnan(probs).any()


@pytest.mark.parametrize("block_size", [None, 4])
def test_fully_masked_rows_are_zero(block_size):
    # Sq > Sk leaves queries 0..2 before every key; the padding masks all of query 5's keys.
    scores = torch.randn(1, 1, 6, 3)
    mask = torch.zeros(1, 1, 6, 3, dtype=torch.bool)
    mask[0, 0, 5] = True
    probs = check_against_float64(scores, 1.0, True, mask, block_size)
    assert torch.all(probs[0, 0, [0, 1, 2, 5]] == 0)
    torch.testing.assert_close(probs[0, 0, [3, 4]].sum(-1), torch.ones(2))


def test_non_contiguous_scores_and_mask():
    torch.manual_seed(3)
    scores = torch.randn(2, 5, 3, 5).transpose(1, 3)  # [2, 5, 3, 5] viewed as strided
    mask = (torch.rand(5, 3) < 0.4).t()  # [Sq, Sk] with a key stride of 3
    assert not scores.is_contiguous() and mask.stride(-1) != 1
    check_against_float64(scores, 0.8, True, mask)


def test_wrapper_runs_triton_under_interpreter(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    from neox.kernels.softmax_kernels import jitted_kernels

    scores = torch.randn(1, 2, 4, 6, requires_grad=True)
    assert triton_available(scores)
    # The kernels were decorated for the interpreter, and the wrapper never touches the reference.
    assert all(isinstance(k, InterpretedFunction) for k in jitted_kernels())

    def no_fallback(*args, **kwargs):
        raise AssertionError("scaled_masked_softmax fell back to the torch reference")

    monkeypatch.setattr(fused_softmax, "scaled_masked_softmax_reference", no_fallback)
    probs = scaled_masked_softmax(scores, 0.5, causal=True)
    probs.sum().backward()
    want = scaled_masked_softmax_reference(scores.detach(), 0.5, causal=True)
    torch.testing.assert_close(probs.detach(), want)


def test_float64_falls_back_even_under_interpreter():
    scores = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    assert not triton_available(scores)
    torch.testing.assert_close(
        scaled_masked_softmax(scores, 1.0),
        scaled_masked_softmax_reference(scores, 1.0, causal=True),
    )
