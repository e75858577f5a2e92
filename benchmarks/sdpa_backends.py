#!/usr/bin/env python
"""torch SDPA backends, forward + backward, at the attention shapes of the Pythia benchmarks
(bf16, causal, q/k/v strided views of one fused QKV projection, as neox's attention makes them):
which backend torch picks by default and what each one costs.

    python benchmarks/sdpa_backends.py                # on a GPU: 160M, 410M and 1.4B shapes
    python benchmarks/sdpa_backends.py --shapes 1-4B --micro-batch 1 --seq 8192 32768
    python benchmarks/sdpa_backends.py --tiny         # CPU smoke run (the math backend)
    python benchmarks/sdpa_backends.py --shapes 1-4B --micro-batch 1 --seq 32768 131072 \
        --context-parallel 1 2 4                      # one rank's attention under CP=1, 2, 4

Prints one JSON line per (shape, backend): milliseconds, TFLOPS of causal attention (half the
4*b*h*s*s*d of full attention, backward counted as 2.5x the forward) and, for the default, the
attention kernels it launched. With --context-parallel N, each row is what one rank of CP=N
runs (neox/parallel/context.py): heads / N over the whole sequence, q, k and v split from one
contiguous (batch, 3 heads / N, seq, head size) buffer as the exchange leaves them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.common import emit  # noqa: E402

# name: (micro batch, heads, head size) of configs/pythia/<name>.yml at seq 2048, and of
# configs/20B.yml (head size 96) at the micro batch of its 4-GPU speed runs.
SHAPES = {"160M": (16, 12, 64), "410M": (8, 16, 64), "1-4B": (4, 16, 128), "6-9B": (4, 32, 128)}
SHAPES |= {"20B": (4, 64, 96)}
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def time_ms(fn, warmup: int, iters: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        tick = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - tick) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def attention_kernels(step, device: torch.device) -> list[str]:
    """Names of the attention kernels one call launches (what the default picked)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    words = ("flash", "cudnn", "fmha", "attention", "sdpa")
    return sorted({e.name[:70] for e in prof.events() if any(w in e.name.lower() for w in words)})


def bench(name: str, b: int, h: int, d: int, s: int, args, device, dtype, cp: int = 0) -> None:
    """cp 0: the one-GPU layout (strided views of a fused QKV projection); cp >= 1: one rank
    of the Ulysses exchange at that size."""
    if cp:
        h //= cp
        qkv = torch.randn(b, 3 * h, s, d, device=device, dtype=dtype, requires_grad=True)
        views = lambda: qkv.split(h, dim=1)  # noqa: E731
    else:
        qkv = torch.randn(b, s, h, 3, d, device=device, dtype=dtype, requires_grad=True)
        views = lambda: (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # noqa: E731
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)

    def step():
        F.scaled_dot_product_attention(*views(), is_causal=True).backward(grad)

    flops = 4 * b * h * s * s * d * 0.5 * 3.5
    for backend in ["default", *args.backends]:
        record = {"shape": name, "b": b, "heads": h, "head_size": d, "seq": s, "backend": backend}
        if cp:
            record["context_parallel"] = cp
        try:
            if backend == "default":
                ms = time_ms(step, args.warmup, args.iters, device)
                record["kernels"] = attention_kernels(step, device)
            else:
                with sdpa_kernel([BACKENDS[backend]]):
                    ms = time_ms(step, args.warmup, args.iters, device)
        except RuntimeError as err:  # a backend that cannot take this shape or device
            record["error"] = str(err).splitlines()[0][:200]
        else:
            record.update(ms=ms, tflops=flops / (ms / 1e3) / 1e12)
        emit(record, args.json)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["160M", "410M", "1-4B"], choices=list(SHAPES))
    p.add_argument("--backends", nargs="+", default=["flash", "cudnn", "efficient"])
    p.add_argument("--seq", type=int, nargs="+", default=[2048])
    p.add_argument("--micro-batch", type=int, default=None, help="in place of the shape's")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="append one JSON record per row here")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (math backend)")
    p.add_argument(
        "--context-parallel",
        type=int,
        nargs="+",
        default=[0],
        help="one CP rank's heads and layout at each size (0: the one-GPU layout)",
    )
    args = p.parse_args()
    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
        args.warmup, args.iters, args.backends = 1, 2, ["math"]
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    else:
        raise SystemExit("sdpa_backends needs a CUDA GPU (or --tiny on CPU)")
    for name in args.shapes:
        for seq in args.seq:
            b, h, d = SHAPES[name]
            b = args.micro_batch or b
            if args.tiny:
                b, h, d, seq = 2, 4, 8, 32
            for cp in args.context_parallel:
                bench(name, b, h, d, seq, args, device, dtype, cp)


if __name__ == "__main__":
    main()
