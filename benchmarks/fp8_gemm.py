#!/usr/bin/env python
"""The matmuls of one Pythia block and its output layer in bf16 and in float8 (tensorwise
scales, torch._scaled_mm as torchao calls it), with and without fast accumulation, and the
cost of torchao's dynamic cast of each operand under torch.compile: what bounds fp8's gain.

python benchmarks/fp8_gemm.py --hidden 4096 --tokens 8192       # the 6.9B width, micro batch 4
python benchmarks/fp8_gemm.py --hidden 2048 --tokens 8192       # 1.4B
python benchmarks/fp8_gemm.py --tiny                            # CPU smoke run

Per matmul of the training step (forward output = x W^T, backward grad_input = g W and
grad_weight = g^T x), prints bf16 and float8 TFLOP/s, float8's speedup with torchao's default
accumulation (fast in the forward only) and with fast accumulation everywhere, and the cast
time (amax, scale, cast: one compiled function per operand, as inductor fuses it when nothing
else is beside it). Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean seconds of fn() over `iters` calls after three warm-up calls."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters
    tick = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - tick) / iters


def to_float8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's tensorwise dynamic cast: scale = max_float8 / amax(x), x * scale clamped."""
    top = torch.finfo(dtype).max
    amax = x.abs().max().float().clamp(min=1e-12)
    scale = top / amax
    return (x.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


# One compilation for every shape (symbolic sizes): amax reduction, then the scaled cast.
_cast = torch.compile(lambda x: to_float8(x, E4M3), dynamic=True)


def matmuls(hidden: int, tokens: int, vocab: int) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of each matmul of a block and the output layer in one training step:
    output = x (M,K) W^T, grad_input = g (M,N) W (N,K), grad_weight = g^T (N,M) x (M,K)."""
    linears = {
        "qkv": (hidden, 3 * hidden),
        "dense": (hidden, hidden),
        "h_to_4h": (hidden, 4 * hidden),
        "4h_to_h": (4 * hidden, hidden),
        "head": (hidden, vocab),
    }
    rows = []
    for name, (k, n) in linears.items():
        rows += [
            (f"{name} out", tokens, k, n),
            (f"{name} grad_in", tokens, n, k),
            (f"{name} grad_w", n, tokens, k),
        ]
    return rows


def bench_matmul(m: int, k: int, n: int, device: torch.device, iters: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
    b = torch.randn(n, k, device=device, generator=g).to(torch.bfloat16)  # row-major (N, K)
    a8, sa = to_float8(a, E4M3)
    b8, sb = to_float8(b, E4M3)
    flops = 2 * m * k * n
    bf16 = timed(lambda: torch.mm(a, b.t()), device, iters)
    fp8 = {
        fast: timed(
            lambda fast=fast: torch._scaled_mm(
                a8, b8.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast
            ),
            device,
            iters,
        )
        for fast in (False, True)
    }
    cast_s = timed(lambda: _cast(a), device, iters) + timed(lambda: _cast(b), device, iters)
    return {
        "bf16_tflops": flops / bf16 / 1e12,
        "fp8_tflops": flops / fp8[False] / 1e12,
        "fp8_fast_tflops": flops / fp8[True] / 1e12,
        "speedup": bf16 / fp8[False],
        "speedup_fast": bf16 / fp8[True],
        "bf16_ms": 1e3 * bf16,
        "fp8_ms": 1e3 * fp8[False],
        "fp8_fast_ms": 1e3 * fp8[True],
        "cast_ms": 1e3 * cast_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192, help="micro batch x sequence length")
    p.add_argument("--vocab", type=int, default=50432, help="padded vocabulary (Pythia's)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="append one JSON record per matmul here")
    p.add_argument("--tiny", action="store_true", help="small shapes on CPU: a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.tokens, args.vocab, args.iters = 64, 128, 256, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{'matmul':>16} {'M':>6} {'K':>6} {'N':>6} {'bf16 TF/s':>9} {'fp8':>6} {'fp8 fast':>8} "
        f"{'x':>5} {'x fast':>6} {'cast ms':>7}"
    )
    totals = {"bf16_ms": 0.0, "fp8_ms": 0.0, "fp8_fast_ms": 0.0, "cast_ms": 0.0}
    fwd_fast = 0.0  # torchao's default: the forward accumulates fast, the backward does not
    records = []
    for label, m, k, n in matmuls(args.hidden, args.tokens, args.vocab):
        rec = {"matmul": label, "m": m, "k": k, "n": n, "device": name}
        rec |= bench_matmul(m, k, n, device, args.iters)
        for key in totals:
            totals[key] += rec[key] if not label.startswith("head") else 0.0
        if not label.startswith("head"):
            fwd_fast += rec["fp8_fast_ms"] if label.endswith("out") else rec["fp8_ms"]
        print(
            f"{label:>16} {m:>6} {k:>6} {n:>6} {rec['bf16_tflops']:>9.0f} "
            f"{rec['fp8_tflops']:>6.0f} {rec['fp8_fast_tflops']:>8.0f} {rec['speedup']:>5.2f} "
            f"{rec['speedup_fast']:>6.2f} {rec['cast_ms']:>7.3f}"
        )
        records.append(rec)
    summary = {
        "hidden": args.hidden,
        "tokens": args.tokens,
        "device": name,
        "block_bf16_ms": totals["bf16_ms"],
        "block_fp8_default_ms": fwd_fast,
        "block_fp8_fast_ms": totals["fp8_fast_ms"],
        "block_cast_ms_upper": totals["cast_ms"],
    }
    print(
        f"one block's matmuls: bf16 {totals['bf16_ms']:.2f} ms, float8 {fwd_fast:.2f} ms "
        f"(torchao's accumulation, x{totals['bf16_ms'] / fwd_fast:.2f}), "
        f"{totals['fp8_fast_ms']:.2f} ms fast everywhere "
        f"(x{totals['bf16_ms'] / totals['fp8_fast_ms']:.2f}); separate casts "
        f"{totals['cast_ms']:.2f} ms at most"
    )
    common.emit(summary, None)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in [*records, summary])
    return 0


if __name__ == "__main__":
    sys.exit(main())
