"""The torch reference against torch.softmax with masked_fill, and its edge cases."""

import pytest
import torch

from neox.kernels.softmax_reference import causal_mask, scaled_masked_softmax_reference


def masked_fill_softmax(x: torch.Tensor, scale: float, masked: torch.Tensor) -> torch.Tensor:
    """The textbook formulation: fill masked scores with -inf, then torch.softmax."""
    return torch.softmax((x * scale).masked_fill(masked, float("-inf")), dim=-1)


def test_causal_mask_offsets_by_cache_length():
    # 2 new queries over 5 keys: query 0 sees keys 0..3, query 1 sees all 5.
    expected = torch.tensor(
        [[False, False, False, False, True], [False, False, False, False, False]]
    )
    assert torch.equal(causal_mask(2, 5), expected)
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).triu(1))


@pytest.mark.parametrize("sq,sk", [(6, 6), (3, 9), (1, 5)])
def test_matches_masked_fill_softmax(sq, sk):
    torch.manual_seed(0)
    x = torch.randn(2, 3, sq, sk, dtype=torch.float64)
    padding = torch.rand(2, 1, 1, sk) < 0.3
    padding[..., -1] = False  # the last key is visible to every query: no fully masked rows
    got = scaled_masked_softmax_reference(x, 0.5, causal=True, padding_mask=padding)
    want = masked_fill_softmax(x, 0.5, causal_mask(sq, sk) | padding)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert torch.all(got[(causal_mask(sq, sk) | padding).expand_as(got)] == 0)


def test_gradient_matches_masked_fill_softmax():
    torch.manual_seed(1)
    x = torch.randn(1, 2, 4, 7, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    grad_out = torch.randn(1, 2, 4, 7, dtype=torch.float64)
    scaled_masked_softmax_reference(x, 0.3, causal=True).backward(grad_out)
    masked_fill_softmax(x2, 0.3, causal_mask(4, 7)).backward(grad_out)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda t: scaled_masked_softmax_reference(t, 0.3, causal=True),
        (x.detach().requires_grad_(),),
    )


def test_fully_masked_rows_are_zero_with_zero_gradient():
    # Sq > Sk: the first two queries come before every key; padding also masks a whole row.
    x = torch.randn(1, 1, 5, 3, dtype=torch.float32, requires_grad=True)
    padding = torch.zeros(1, 1, 5, 3, dtype=torch.bool)
    padding[0, 0, 4] = True
    probs = scaled_masked_softmax_reference(x, 1.0, causal=True, padding_mask=padding)
    assert not torch.isnan(probs).any()
    assert torch.all(probs[0, 0, [0, 1, 4]] == 0)
    torch.testing.assert_close(probs[0, 0, [2, 3]].sum(-1), torch.ones(2))
    probs.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.all(x.grad[0, 0, [0, 1, 4]] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_computed_in_float32(dtype):
    torch.manual_seed(2)
    x = (4 * torch.randn(2, 2, 8, 8)).to(dtype)
    got = scaled_masked_softmax_reference(x, 0.7, causal=True)
    assert got.dtype == dtype
    want = masked_fill_softmax(x.float(), 0.7, causal_mask(8, 8)).to(dtype)
    torch.testing.assert_close(got, want)  # dtype-aware tolerance: within rounding of fp32 math


def test_rejects_one_dimensional_scores():
    with pytest.raises(ValueError, match="at least 2 dims"):
        scaled_masked_softmax_reference(torch.randn(5), 1.0, causal=False)
