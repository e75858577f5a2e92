"""Fused scale + causal/padding mask + softmax for attention scores [B, H, Sq, Sk].

y = softmax(scale * x + mask) over the last dim, where the mask puts -inf on every key j with
j > i + (Sk - Sq) (when causal) and wherever ``padding_mask`` is True; fully masked rows give 0.
The Triton kernels (``softmax_kernels``) replace gpt-neox's CUDA
``scaled_upper_triang_masked_softmax`` / ``scaled_masked_softmax`` extensions; where Triton cannot
run, ``scaled_masked_softmax`` falls back to the torch reference, which gives the same numbers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from neox.kernels.softmax_reference import scaled_masked_softmax_reference

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rows up to this length are held in registers in one block (one read of the input); longer
# rows are streamed in blocks of this size over two passes.
MAX_BLOCK_SIZE = 8192


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _interpreter_ready() -> bool:
    # Triton's own library functions (tl.max, tl.sum) are decorated when triton is imported, so
    # the interpreter only works if TRITON_INTERPRET=1 was already set at that moment.
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.max, InterpretedFunction):
        return True
    logger.warning(
        "TRITON_INTERPRET=1 was set after triton was imported, so Triton's interpreter cannot run "
        "the softmax kernels; using the torch reference. Set it before anything imports triton."
    )
    return False


def triton_available(tensor: torch.Tensor) -> bool:
    """Whether ``scaled_masked_softmax`` runs the Triton kernels on ``tensor`` (else the reference)."""
    if tensor.dtype not in SUPPORTED_DTYPES or not _triton_importable():
        return False
    if tensor.is_cuda:
        return True
    # On CPU only Triton's interpreter can run the kernels (slowly; meant for tests).
    if tensor.device.type != "cpu" or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    return _interpreter_ready()


def _check_inputs(scores: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> None:
    if scores.dim() != 4:
        raise ValueError(
            f"scores must be 4-D [batch, heads, q_len, k_len], got shape {tuple(scores.shape)}; "
            "reshape before calling scaled_masked_softmax"
        )
    if padding_mask is None:
        return
    if padding_mask.dtype != torch.bool:
        raise TypeError(
            f"padding_mask must be a bool tensor (True = masked out), got {padding_mask.dtype}; "
            "convert it with `mask.bool()` or `mask == 0` for a 1 = keep mask"
        )
    try:
        broadcast = torch.broadcast_shapes(padding_mask.shape, scores.shape)
    except RuntimeError:
        broadcast = None
    if broadcast != scores.shape:
        raise ValueError(
            f"padding_mask of shape {tuple(padding_mask.shape)} does not broadcast to scores "
            f"{tuple(scores.shape)}; give it shape [B or 1, H or 1, Sq or 1, Sk]"
        )
    if padding_mask.device != scores.device:
        raise ValueError(
            f"padding_mask is on {padding_mask.device} but scores on {scores.device}; "
            "move the mask to the scores' device"
        )


def _block_size(sk: int, block_size: Optional[int]) -> int:
    if block_size is None:
        return min(_next_power_of_2(sk), MAX_BLOCK_SIZE)
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return block_size


def _next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (at least 1)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class KernelConfig:
    """How a launch splits the rows: ``rows`` per program, ``num_warps`` threads per program."""

    rows: int
    num_warps: int

    def __str__(self) -> str:
        return f"rows={self.rows},warps={self.num_warps}"


# Overrides default_config for every launch, e.g. "rows=2,warps=4": lets a whole training run
# try a variant that benchmarks/fused_softmax.py --sweep measured faster.
CONFIG_ENV = "NEOX_SOFTMAX_CONFIG"


def default_config(block: int) -> KernelConfig:
    """About 2048 elements per program and 16 per thread (two 16-byte loads of fp16/bf16).

    Rows shorter than 2048 share a program, so short rows do not each pay a launch slot and two
    block-wide reductions. An SM holds at most 64 warps whatever their size, so more elements
    per thread keep more bytes in flight; past ~32 the backward needs ~80 registers a thread,
    which cuts the warps an SM can hold to ~24.
    """
    override = os.environ.get(CONFIG_ENV)
    if override:
        return parse_config(override)
    rows = max(1, 2048 // block)
    return KernelConfig(rows, num_warps=min(max(rows * block // (32 * 16), 1), 16))


def candidate_configs(block: int) -> list[KernelConfig]:
    """Variants for a benchmark sweep: 1-4 rows per program at 8-32 elements per thread."""
    configs = []
    for rows in (1, 2, 4):
        for warps in (1, 2, 4, 8, 16):
            per_thread = rows * block // (32 * warps)
            if 8 <= per_thread <= 32 and rows * block <= 4 * MAX_BLOCK_SIZE:
                configs.append(KernelConfig(rows, warps))
    return configs or [default_config(block)]


def parse_config(text: str) -> KernelConfig:
    """``"rows=2,warps=4"`` -> KernelConfig(2, 4); both positive, warps a power of two."""
    try:
        fields = dict(part.split("=") for part in text.replace(" ", "").split(","))
        config = KernelConfig(int(fields.pop("rows")), int(fields.pop("warps")))
        ok = not fields and config.rows > 0 and 0 < config.num_warps <= 32
        ok = ok and config.rows & (config.rows - 1) == 0
        ok = ok and config.num_warps & (config.num_warps - 1) == 0
    except (KeyError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"{CONFIG_ENV}={text!r} is not a softmax kernel config; write it as "
            '"rows=R,warps=W" with R and W powers of two (W <= 32), e.g. "rows=2,warps=4", '
            "or unset it for the default"
        )
    return config


def _vector_width(sk: int, dtype: torch.dtype) -> int:
    # Loads are rounded up to whole 16-byte vectors, which must not pass the end of the row.
    vec = 16 // (torch.finfo(dtype).bits // 8)
    return vec if sk % vec == 0 else 1


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


def _on_device(tensor: torch.Tensor):
    # Triton launches on the current CUDA device, which need not be the tensor's.
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _launch_forward(
    scores: torch.Tensor,
    scale: float,
    causal: bool,
    padding_mask: Optional[torch.Tensor],
    block_size: Optional[int],
    config: Optional[KernelConfig],
) -> torch.Tensor:
    from neox.kernels.softmax_kernels import jitted_kernels

    forward_kernel, _ = jitted_kernels()
    x = scores.contiguous()
    y = torch.empty_like(x)
    b, h, sq, sk = x.shape
    block = _block_size(sk, block_size)
    if padding_mask is not None:
        # Stride-0 broadcast dims let the kernel read a [B, 1, 1, Sk] mask without copying it.
        mask = padding_mask.view(torch.uint8).expand(x.shape)
        mask_strides = mask.stride()
    else:
        mask, mask_strides = x, (0, 0, 0, 0)  # never read: HAS_MASK is False
    config = config or default_config(block)
    n_rows = b * h * sq
    with _on_device(x):
        forward_kernel[(_cdiv(n_rows, config.rows),)](
            x,
            y,
            mask,
            float(scale),
            n_rows,
            h,
            sq,
            sk,
            *mask_strides,
            CAUSAL=causal,
            HAS_MASK=padding_mask is not None,
            BLOCK=block,
            SINGLE_BLOCK=sk <= block,
            ROWS=config.rows,
            VEC=_vector_width(sk, x.dtype),
            num_warps=config.num_warps,
        )
    return y


def _launch_backward(
    probs: torch.Tensor,
    grad_probs: torch.Tensor,
    scale: float,
    causal: bool,
    block_size: Optional[int],
    config: Optional[KernelConfig],
) -> torch.Tensor:
    from neox.kernels.softmax_kernels import jitted_kernels

    _, backward_kernel = jitted_kernels()
    dy = grad_probs.contiguous()
    dx = torch.empty_like(probs)
    b, h, sq, sk = probs.shape
    block = _block_size(sk, block_size)
    config = config or default_config(block)
    n_rows = b * h * sq
    with _on_device(probs):
        backward_kernel[(_cdiv(n_rows, config.rows),)](
            probs,
            dy,
            dx,
            float(scale),
            n_rows,
            sq,
            sk,
            CAUSAL=causal,
            BLOCK=block,
            SINGLE_BLOCK=sk <= block,
            ROWS=config.rows,
            VEC=_vector_width(sk, probs.dtype),
            num_warps=config.num_warps,
        )
    return dx


class FusedScaledMaskedSoftmax(torch.autograd.Function):
    """y = softmax(scale * x, masked) in one kernel; dx = scale * y * (dy - sum(dy * y))."""

    @staticmethod
    def forward(
        ctx,
        scores: torch.Tensor,
        scale: float,
        causal: bool,
        padding_mask: Optional[torch.Tensor],
        block_size: Optional[int],
        config: Optional[KernelConfig],
    ) -> torch.Tensor:
        probs = _launch_forward(scores, scale, causal, padding_mask, block_size, config)
        # Only y is kept: the backward needs neither x nor the mask (masked y are 0).
        ctx.save_for_backward(probs)
        ctx.scale, ctx.causal, ctx.block_size, ctx.config = scale, causal, block_size, config
        return probs

    @staticmethod
    def backward(ctx, grad_probs: torch.Tensor):
        (probs,) = ctx.saved_tensors
        grad_scores = _launch_backward(
            probs, grad_probs, ctx.scale, ctx.causal, ctx.block_size, ctx.config
        )
        return grad_scores, None, None, None, None, None


def fused_scaled_masked_softmax(
    scores: torch.Tensor,
    scale: float,
    causal: bool = True,
    padding_mask: Optional[torch.Tensor] = None,
    block_size: Optional[int] = None,
    config: Optional[KernelConfig] = None,
) -> torch.Tensor:
    """The Triton path only; raises when it cannot run. ``block_size`` overrides the row block,
    ``config`` the launch split (default: ``default_config``)."""
    _check_inputs(scores, padding_mask)
    _block_size(scores.shape[-1], block_size)  # reject a bad override before anything runs
    if not triton_available(scores):
        raise RuntimeError(
            f"the Triton softmax cannot run on a {scores.dtype} tensor on {scores.device}: it "
            f"needs triton installed, dtype in {[str(d) for d in SUPPORTED_DTYPES]}, and a CUDA "
            "tensor (or TRITON_INTERPRET=1 for CPU); use scaled_masked_softmax to fall back"
        )
    return FusedScaledMaskedSoftmax.apply(scores, scale, causal, padding_mask, block_size, config)


def scaled_masked_softmax(
    scores: torch.Tensor,
    scale: float,
    causal: bool = True,
    padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Softmax of ``scale * scores`` over keys with causal/padding masks, in the input dtype.

    Args:
        scores: [B, H, Sq, Sk] attention scores (fp32, fp16 or bf16 for the Triton path).
        scale: multiplier applied before the softmax, usually 1/sqrt(head_dim).
        causal: mask key j > query i + (Sk - Sq), so Sq < Sk works with a KV cache.
        padding_mask: bool, broadcastable to ``scores``, True = masked out.
    """
    _check_inputs(scores, padding_mask)
    if scores.numel() == 0 or not triton_available(scores):
        return scaled_masked_softmax_reference(scores, scale, causal, padding_mask)
    return FusedScaledMaskedSoftmax.apply(scores, scale, causal, padding_mask, None, None)
