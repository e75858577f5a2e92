"""The Triton softmax compiled on a CUDA GPU against a float64 reference, up to 8192 keys."""

import pytest
import torch

from neox.kernels.fused_softmax import (
    MAX_BLOCK_SIZE,
    candidate_configs,
    fused_scaled_masked_softmax,
    scaled_masked_softmax,
    triton_available,
)
from tests.kernels.softmax_helpers import check_against_float64

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed"),
]

# (probs rtol, probs atol, grad error / max |grad|): the stored probs are rounded to the dtype.


def key_padding(b: int, sk: int) -> torch.Tensor:
    """[B, 1, 1, Sk] mask where batch 0 is right-padded to half length."""
    mask = torch.zeros(b, 1, 1, sk, dtype=torch.bool, device="cuda")
    mask[0, ..., sk // 2 :] = True
    return mask


# (B, H, Sq, Sk, causal, padding, block_size)
CASES = [
    (2, 4, 128, 128, True, False, None),
    (2, 3, 100, 1000, True, True, None),  # odd sizes
    (2, 2, 33, 1000, False, True, 256),  # forced two-pass loop
    (1, 2, 64, 8192, True, True, None),  # decoding-style Sq < Sk at 8192 keys
    (1, 2, 16, MAX_BLOCK_SIZE + 4097, False, True, None),  # longer than one block
    (1, 1, 40, 24, True, True, None),  # Sq > Sk: fully masked leading rows
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,h,sq,sk,causal,padding,block_size", CASES)
def test_matches_float64_reference(dtype, b, h, sq, sk, causal, padding, block_size):
    torch.manual_seed(sq + sk)
    scores = (3 * torch.randn(b, h, sq, sk, device="cuda")).to(dtype)
    mask = key_padding(b, sk) if padding else None
    probs = check_against_float64(scores, 0.125, causal, mask, block_size)
    assert not torch.isnan(probs).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_full_causal_square_at_8192(dtype):
    torch.manual_seed(0)
    scores = (3 * torch.randn(1, 1, 8192, 8192, device="cuda")).to(dtype)
    check_against_float64(scores, 0.0884, True, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sk,block_size", [(1024, None), (2048, None), (4096, None), (2048, 512)])
def test_every_benchmarked_config_matches_float64_reference(dtype, sk, block_size):
    """Each variant benchmarks/fused_softmax.py --sweep may pick is correct (causal, Sq = Sk)."""
    torch.manual_seed(sk)
    scores = (3 * torch.randn(1, 3, sk, sk, device="cuda")).to(dtype)
    for config in candidate_configs(block_size or sk):
        check_against_float64(scores, 0.125, True, None, block_size, config)


def test_wrapper_takes_triton_path_on_cuda():
    scores = torch.randn(2, 2, 16, 16, device="cuda", dtype=torch.bfloat16)
    assert triton_available(scores)
    assert not triton_available(scores.double())
    want = fused_scaled_masked_softmax(scores, 0.5)
    assert torch.equal(scaled_masked_softmax(scores, 0.5), want)


def test_adamw_step_reaches_past_two_to_the_31_elements():
    """A one-GPU flat buffer of 2**31 + 3 blocks (a 2.2B-parameter model): the last elements
    are stepped like the first (int32 offsets wrapped around and faulted)."""
    from neox.kernels.adamw import adamw_step_

    n = 2**31 + 3 * 4096
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs 40 GiB of GPU memory for a 2**31-element buffer")
    param = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    grad = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    master = torch.zeros(n, device="cuda")
    exp_avg, exp_avg_sq = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    one = torch.ones((), device="cuda")
    adamw_step_(
        param,
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        one,
        one,
        torch.zeros((), device="cuda"),
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
    )
    torch.cuda.synchronize()
    for t in (master[:4096], master[-4096:]):  # lr * m_hat / sqrt(v_hat) = lr * 1 / 1
        assert torch.allclose(t, torch.full_like(t, -1e-2), rtol=1e-4), t[:4]
    assert param[-1].item() == pytest.approx(-1e-2, rel=1e-2)
