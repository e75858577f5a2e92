"""One AdamW step over flat buffers in a single pass (Triton), for bf16 parameters with fp32
master weights.

Reads each element's bf16 gradient, fp32 master weight and the two moments once and writes the
master weight, the moments and the bf16 parameter once: 28 bytes an element. The same step from
torch's pieces (cast the gradients to fp32, fused AdamW, copy the master weights back into bf16)
moves 40. The gradient is divided by `grad_scale` (the clipping factor) inside the kernel, and
nothing is written when `found_inf` is nonzero, so a step with non-finite gradients is skipped
without a host sync. The arithmetic is torch's AdamW (decoupled weight decay, bias-corrected
moments, eps added to the corrected root); the bias corrections come from the step count held
on the device.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _adamw_kernel(
    param_ptr,
    master_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    step_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    n,
    lr,
    beta1,
    beta2,
    log2_beta1,
    log2_beta2,
    eps,
    weight_decay,
    BLOCK: tl.constexpr,
):
    # 64-bit offsets: one flat buffer of a one-GPU run past 2**31 elements (2.1B parameters)
    # would wrap around in int32.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # A skipped step loads and stores nothing.
    mask = offs < tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    step = tl.load(step_ptr)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_root = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(grad_scale_ptr)
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_root + eps)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)


def adamw_step_(
    param: torch.Tensor,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    grad_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """In place on flat contiguous tensors: param (bf16/fp16) and master, exp_avg, exp_avg_sq
    (fp32) of one size; grad of that size in any float dtype; step (fp32 scalar, already
    counting this step), grad_scale and found_inf scalars on the same device."""
    n = master.numel()
    for t in (param, grad, exp_avg, exp_avg_sq):
        assert t.numel() == n and t.is_contiguous()
    beta1, beta2 = betas
    block = 4096
    _adamw_kernel[(triton.cdiv(n, block),)](
        param,
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        step,
        grad_scale,
        found_inf,
        n,
        lr,
        beta1,
        beta2,
        _log2(beta1),
        _log2(beta2),
        eps,
        weight_decay,
        BLOCK=block,
        num_warps=8,
    )


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else -math.inf  # beta**step = exp2(step * log2(beta))
