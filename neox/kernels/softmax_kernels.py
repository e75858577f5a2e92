"""Triton kernels for scale + causal/padding mask + softmax over rows, forward and backward.

The kernels are plain functions handed to ``triton.jit`` on first use (see ``jitted_kernels``):
Triton picks compiled or interpreted mode when a function is decorated, so this module can be
imported before ``TRITON_INTERPRET`` is settled. (The interpreter also needs the variable set
before triton itself is imported; ``fused_softmax.triton_available`` checks that.)

Each program takes ROWS consecutive rows of the contiguous [B, H, Sq, Sk] tensor, held in
registers when a row fits one block (SINGLE_BLOCK), else streamed in blocks over two passes.
Loads cover a row's visible keys rounded up to VEC elements: a bound that is a multiple of VEC
lets Triton emit 16-byte vector loads, where the exact causal bound (any integer) forces one
2-byte load per element. The extra keys read are masked to -inf / 0 in registers, so they never
change a result.
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
    n_rows,
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
    ROWS: tl.constexpr,
    VEC: tl.constexpr,
):
    # int64 because B*H*Sq*Sk passes 2**31 at long sequence lengths.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    row_ok = rows < n_rows
    q = rows % sq
    b = rows // (sq * n_heads)
    h = (rows // sq) % n_heads
    # Keys past n_visible are causally masked; it is <= 0 for early queries when Sq > Sk.
    if CAUSAL:
        n_visible = tl.maximum(tl.minimum(q + (sk - sq) + 1, sk), 0)
    else:
        n_visible = tl.zeros([ROWS], tl.int64) + sk
    n_load = (n_visible + VEC - 1) // VEC * VEC  # <= sk: the launcher sets VEC | sk
    x_rows = x_ptr + rows * sk
    y_rows = y_ptr + rows * sk
    mask_rows = mask_ptr + b * mask_stride_b + h * mask_stride_h + q * mask_stride_q
    cols = tl.arange(0, BLOCK)

    if SINGLE_BLOCK:
        c = cols[None, :]  # (1, BLOCK) against (ROWS, 1) row values
        keep = (c < n_visible[:, None]) & row_ok[:, None]
        if HAS_MASK:
            padded = tl.load(mask_rows[:, None] + c * mask_stride_k, mask=keep, other=1)
            keep = keep & (padded == 0)
        load_ok = (c < n_load[:, None]) & row_ok[:, None]
        x = tl.load(x_rows[:, None] + c, mask=load_ok, other=0.0).to(tl.float32) * scale
        x = tl.where(keep, x, float("-inf"))
        row_max = tl.max(x, axis=1)
        # A fully masked row has max -inf; shifting by 0 instead makes every exp 0, not NaN.
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        e = tl.exp(x - row_max[:, None])
        total = tl.sum(e, axis=1)
        inv_total = 1.0 / tl.where(total > 0.0, total, 1.0)
        y = e * inv_total[:, None]
        tl.store(y_rows[:, None] + c, y.to(y_ptr.dtype.element_ty), mask=(c < sk) & row_ok[:, None])
    else:
        # Pass 1: per-lane running max and rescaled running sum (online softmax), reduced at
        # the end; lanes keep the loop free of reductions. The loop runs to the longest row.
        lane_max = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
        lane_sum = tl.zeros([ROWS, BLOCK], tl.float32)
        for start in range(0, tl.max(n_visible, axis=0), BLOCK):
            c = start + cols[None, :]
            keep = (c < n_visible[:, None]) & row_ok[:, None]
            if HAS_MASK:
                padded = tl.load(mask_rows[:, None] + c * mask_stride_k, mask=keep, other=1)
                keep = keep & (padded == 0)
            load_ok = (c < n_load[:, None]) & row_ok[:, None]
            x = tl.load(x_rows[:, None] + c, mask=load_ok, other=0.0).to(tl.float32) * scale
            x = tl.where(keep, x, float("-inf"))
            new_max = tl.maximum(lane_max, x)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
            lane_max = new_max
        row_max = tl.max(lane_max, axis=1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        total = tl.sum(lane_sum * tl.exp(lane_max - row_max[:, None]), axis=1)
        inv_total = 1.0 / tl.where(total > 0.0, total, 1.0)
        # Pass 2: normalise; masked columns (including all past n_visible) are written as 0.
        for start in range(0, sk, BLOCK):
            c = start + cols[None, :]
            keep = (c < n_visible[:, None]) & row_ok[:, None]
            if HAS_MASK:
                padded = tl.load(mask_rows[:, None] + c * mask_stride_k, mask=keep, other=1)
                keep = keep & (padded == 0)
            load_ok = (c < n_load[:, None]) & row_ok[:, None]
            x = tl.load(x_rows[:, None] + c, mask=load_ok, other=0.0).to(tl.float32) * scale
            x = tl.where(keep, x, float("-inf"))
            y = tl.exp(x - row_max[:, None]) * inv_total[:, None]
            store_ok = (c < sk) & row_ok[:, None]
            tl.store(y_rows[:, None] + c, y.to(y_ptr.dtype.element_ty), mask=store_ok)


def _softmax_backward_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    scale,
    n_rows,
    sq,
    sk,
    CAUSAL: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    VEC: tl.constexpr,
):
    # dx = scale * y * (dy - sum(dy * y)). Masked positions have y == 0, so they get dx == 0
    # without reading the padding mask; causally masked columns are not loaded (bar the few
    # that round the load up to VEC, zeroed below since dy there is arbitrary).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    row_ok = rows < n_rows
    q = rows % sq
    if CAUSAL:
        n_visible = tl.maximum(tl.minimum(q + (sk - sq) + 1, sk), 0)
    else:
        n_visible = tl.zeros([ROWS], tl.int64) + sk
    n_load = (n_visible + VEC - 1) // VEC * VEC
    y_rows = y_ptr + rows * sk
    dy_rows = dy_ptr + rows * sk
    dx_rows = dx_ptr + rows * sk
    cols = tl.arange(0, BLOCK)

    if SINGLE_BLOCK:
        c = cols[None, :]
        keep = (c < n_visible[:, None]) & row_ok[:, None]
        load_ok = (c < n_load[:, None]) & row_ok[:, None]
        y = tl.load(y_rows[:, None] + c, mask=load_ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_rows[:, None] + c, mask=load_ok, other=0.0).to(tl.float32)
        y = tl.where(keep, y, 0.0)
        dy = tl.where(keep, dy, 0.0)
        dot = tl.sum(y * dy, axis=1)
        dx = scale * y * (dy - dot[:, None])
        tl.store(
            dx_rows[:, None] + c, dx.to(dx_ptr.dtype.element_ty), mask=(c < sk) & row_ok[:, None]
        )
    else:
        acc = tl.zeros([ROWS, BLOCK], tl.float32)
        for start in range(0, tl.max(n_visible, axis=0), BLOCK):
            c = start + cols[None, :]
            keep = (c < n_visible[:, None]) & row_ok[:, None]
            load_ok = (c < n_load[:, None]) & row_ok[:, None]
            y = tl.load(y_rows[:, None] + c, mask=load_ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_rows[:, None] + c, mask=load_ok, other=0.0).to(tl.float32)
            acc += tl.where(keep, y * dy, 0.0)
        dot = tl.sum(acc, axis=1)
        for start in range(0, sk, BLOCK):
            c = start + cols[None, :]
            keep = (c < n_visible[:, None]) & row_ok[:, None]
            load_ok = (c < n_load[:, None]) & row_ok[:, None]
            y = tl.load(y_rows[:, None] + c, mask=load_ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_rows[:, None] + c, mask=load_ok, other=0.0).to(tl.float32)
            dx = tl.where(keep, scale * y * (dy - dot[:, None]), 0.0)
            store_ok = (c < sk) & row_ok[:, None]
            tl.store(dx_rows[:, None] + c, dx.to(dx_ptr.dtype.element_ty), mask=store_ok)


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
