"""Triton kernels for scale + causal/padding mask + softmax over rows, forward and backward.

The kernels are plain functions handed to ``triton.jit`` on first use (see ``jitted_kernels``):
Triton picks compiled or interpreted mode when a function is decorated, so this module can be
imported before ``TRITON_INTERPRET`` is settled. (The interpreter also needs the variable set
before triton itself is imported; ``fused_softmax.triton_available`` checks that.)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import triton
import triton.language as tl


def _softmax_forward_kernel(
    x_ptr,
    y_ptr,
    mask_ptr,
    scale,
    n_heads,
    sq,
    sk,
    mask_stride_b,
    mask_stride_h,
    mask_stride_q,
    mask_stride_k,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    # One program per row of the contiguous [B, H, Sq, Sk] tensor; int64 because B*H*Sq*Sk
    # passes 2**31 at long sequence lengths.
    row = tl.program_id(0).to(tl.int64)
    q = row % sq
    b = row // (sq * n_heads)
    h = (row // sq) % n_heads
    x_row = x_ptr + row * sk
    y_row = y_ptr + row * sk
    mask_row = mask_ptr + b * mask_stride_b + h * mask_stride_h + q * mask_stride_q
    # Keys past n_visible are causally masked; it is <= 0 for early queries when Sq > Sk.
    if CAUSAL:
        n_visible = tl.minimum(q + (sk - sq) + 1, sk).to(tl.int32)
    else:
        n_visible = sk
    cols = tl.arange(0, BLOCK)

    if SINGLE_BLOCK:
        keep = cols < n_visible
        if HAS_MASK:
            padded = tl.load(mask_row + cols * mask_stride_k, mask=keep, other=1)
            keep = keep & (padded == 0)
        x = tl.load(x_row + cols, mask=keep, other=0.0).to(tl.float32) * scale
        x = tl.where(keep, x, float("-inf"))
        row_max = tl.max(x, axis=0)
        # A fully masked row has max -inf; shifting by 0 instead makes every exp 0, not NaN.
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        e = tl.exp(x - row_max)
        total = tl.sum(e, axis=0)
        total = tl.where(total > 0.0, total, 1.0)
        tl.store(y_row + cols, (e / total).to(y_ptr.dtype.element_ty), mask=cols < sk)
    else:
        # Pass 1: per-lane running max and rescaled running sum (online softmax), reduced at
        # the end; lanes avoid loop-carried scalars and keep the loop free of reductions.
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_visible, BLOCK):
            c = start + cols
            keep = c < n_visible
            if HAS_MASK:
                padded = tl.load(mask_row + c * mask_stride_k, mask=keep, other=1)
                keep = keep & (padded == 0)
            x = tl.load(x_row + c, mask=keep, other=0.0).to(tl.float32) * scale
            x = tl.where(keep, x, float("-inf"))
            new_max = tl.maximum(lane_max, x)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
            lane_max = new_max
        row_max = tl.max(lane_max, axis=0)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        total = tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0)
        total = tl.where(total > 0.0, total, 1.0)
        # Pass 2: normalise; masked columns (including all past n_visible) are written as 0.
        for start in range(0, sk, BLOCK):
            c = start + cols
            keep = c < n_visible
            if HAS_MASK:
                padded = tl.load(mask_row + c * mask_stride_k, mask=keep, other=1)
                keep = keep & (padded == 0)
            x = tl.load(x_row + c, mask=keep, other=0.0).to(tl.float32) * scale
            x = tl.where(keep, x, float("-inf"))
            y = tl.exp(x - row_max) / total
            tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=c < sk)


def _softmax_backward_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    scale,
    sq,
    sk,
    CAUSAL: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    # dx = scale * y * (dy - sum(dy * y)). Masked positions have y == 0, so they get dx == 0
    # without reading the padding mask; causally masked columns are not even loaded.
    row = tl.program_id(0).to(tl.int64)
    q = row % sq
    y_row = y_ptr + row * sk
    dy_row = dy_ptr + row * sk
    dx_row = dx_ptr + row * sk
    if CAUSAL:
        n_visible = tl.minimum(q + (sk - sq) + 1, sk).to(tl.int32)
    else:
        n_visible = sk
    cols = tl.arange(0, BLOCK)

    if SINGLE_BLOCK:
        keep = cols < n_visible
        y = tl.load(y_row + cols, mask=keep, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=keep, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, axis=0)
        dx = scale * y * (dy - dot)
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < sk)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_visible, BLOCK):
            c = start + cols
            keep = c < n_visible
            y = tl.load(y_row + c, mask=keep, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + c, mask=keep, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, axis=0)
        for start in range(0, sk, BLOCK):
            c = start + cols
            keep = c < n_visible
            y = tl.load(y_row + c, mask=keep, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + c, mask=keep, other=0.0).to(tl.float32)
            dx = scale * y * (dy - dot)
            tl.store(dx_row + c, dx.to(dx_ptr.dtype.element_ty), mask=c < sk)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _jit(interpret: bool) -> tuple[Callable, Callable]:
    # `interpret` is only the cache key: triton.jit reads TRITON_INTERPRET itself.
    return triton.jit(_softmax_forward_kernel), triton.jit(_softmax_backward_kernel)


def jitted_kernels() -> tuple[Callable, Callable]:
    """(forward, backward) kernels decorated for the current TRITON_INTERPRET mode."""
    return _jit(interpreting())
