"""GPU micro-benchmark: Triton fused scale-mask-softmax vs the torch reference vs masked_fill+softmax.

Times forward and forward+backward on causal [B, H, S, S] scores and prints a markdown table with
median milliseconds and effective bandwidth: every element of x, y, dy, dx counted once, divided by
the time. The fused kernel skips reading causally masked scores, so its figure can exceed HBM's.

    python benchmarks/fused_softmax.py --dtype bf16 --seq 1024 2048 4096 8192
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from neox.kernels.fused_softmax import fused_scaled_masked_softmax  # noqa: E402
from neox.kernels.softmax_reference import causal_mask, scaled_masked_softmax_reference  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def masked_fill_softmax(x: torch.Tensor, scale: float, masked: torch.Tensor) -> torch.Tensor:
    """The usual unfused path: upcast, scale, fill masked with -inf, softmax, cast back."""
    return torch.softmax((x.float() * scale).masked_fill(masked, float("-inf")), -1).to(x.dtype)


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench_one(batch: int, heads: int, seq: int, dtype: torch.dtype, warmup: int, iters: int):
    """Rows of (method, forward ms, fwd+bwd ms) for one shape."""
    scale = 0.125
    x = torch.randn(batch, heads, seq, seq, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    masked = causal_mask(seq, seq, device="cuda")
    methods = {
        "triton fused": lambda t: fused_scaled_masked_softmax(t, scale, causal=True),
        "torch reference": lambda t: scaled_masked_softmax_reference(t, scale, causal=True),
        "masked_fill+softmax": lambda t: masked_fill_softmax(t, scale, masked),
    }
    rows = []
    for name, op in methods.items():
        with torch.no_grad():
            fwd = time_ms(lambda op=op: op(x), warmup, iters)

        def fwd_bwd(op=op):
            x.grad = None
            op(x).backward(grad)

        rows.append((name, fwd, time_ms(fwd_bwd, warmup, iters)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fused_softmax benchmark needs a CUDA GPU; none is visible to torch here")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("fused_softmax benchmark needs triton; pip install triton") from None

    dtype = DTYPES[args.dtype]
    elem = torch.finfo(dtype).bits // 8
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, ", end="")
    print(f"triton {triton.__version__}, dtype {args.dtype}, B={args.batch}, H={args.heads}")
    print("| seq | method | fwd ms | fwd GB/s | fwd+bwd ms | fwd+bwd GB/s |")
    print("|---:|---|---:|---:|---:|---:|")
    for seq in args.seq:
        n = args.batch * args.heads * seq * seq
        # Dense traffic: forward reads x, writes y; backward reads y and dy, writes dx.
        fwd_bytes, fwd_bwd_bytes = 2 * n * elem, 5 * n * elem
        for name, fwd, both in bench_one(
            args.batch, args.heads, seq, dtype, args.warmup, args.iters
        ):
            print(
                f"| {seq} | {name} | {fwd:.3f} | {fwd_bytes / fwd / 1e6:.0f} "
                f"| {both:.3f} | {fwd_bwd_bytes / both / 1e6:.0f} |"
            )
        torch.cuda.empty_cache()  # the reference's fp32 temporaries at 8192 are gigabytes


if __name__ == "__main__":
    main()
