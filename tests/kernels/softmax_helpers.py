"""The check shared by the interpreted (CPU) and compiled (GPU) kernel tests."""

import torch

from neox.kernels.fused_softmax import fused_scaled_masked_softmax
from neox.kernels.softmax_reference import scaled_masked_softmax_reference

# dtype -> (forward rtol, forward atol, gradient error relative to max |grad|)
TOLERANCES = {
    torch.float32: (1e-5, 1e-7, 1e-5),
    torch.float16: (2e-3, 2e-5, 4e-3),
    torch.bfloat16: (1.6e-2, 2e-4, 3e-2),
}


def check_against_float64(scores, scale, causal, padding_mask, block_size=None, config=None):
    """Forward and backward of the Triton path vs the float64 reference on the same inputs."""
    torch.manual_seed(123)
    rtol, atol, grad_tol = TOLERANCES[scores.dtype]
    x = scores.detach().requires_grad_()
    probs = fused_scaled_masked_softmax(x, scale, causal, padding_mask, block_size, config)
    grad_out = torch.randn(probs.shape, device=scores.device).to(scores.dtype)
    probs.backward(grad_out)

    x64 = scores.detach().double().requires_grad_()
    want = scaled_masked_softmax_reference(x64, scale, causal, padding_mask)
    want.backward(grad_out.double())

    assert probs.dtype == scores.dtype and x.grad.dtype == scores.dtype
    torch.testing.assert_close(probs.double(), want.detach(), rtol=rtol, atol=atol)
    grad_err = (x.grad.double() - x64.grad).abs().max()
    assert grad_err <= grad_tol * x64.grad.abs().max(), f"grad error {grad_err:.3g}"
    return probs
