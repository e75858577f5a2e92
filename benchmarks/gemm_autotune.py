#!/usr/bin/env python
"""The block linears of a Pythia shape, forward, bf16: cuBLAS (what neox's compiled blocks call)
against torch.compile's max-autotune GEMM search (Triton templates beside cuBLAS, the fastest
kept), to see whether `mode="max-autotune-no-cudagraphs"` would speed up the matmuls.

    python benchmarks/gemm_autotune.py                     # 1.4B, 8192 tokens (micro batch 4)
    python benchmarks/gemm_autotune.py --tiny              # CPU smoke run (no autotuning)

One JSON line per linear: milliseconds and TFLOPS of each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.common import emit  # noqa: E402
from benchmarks.sdpa_backends import time_ms  # noqa: E402

# name: (hidden, vocab) of configs/pythia/<name>.yml; the linears are (out, in) of a block.
SHAPES = {"410M": (1024, 50432), "1-4B": (2048, 50432)}


def linears(hidden: int, vocab: int) -> dict[str, tuple[int, int]]:
    return {
        "query_key_value": (3 * hidden, hidden),
        "dense": (hidden, hidden),
        "dense_h_to_4h": (4 * hidden, hidden),
        "dense_4h_to_h": (hidden, 4 * hidden),
        "output_layer": (vocab, hidden),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1-4B", choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--only", nargs="+", default=None, help="these linears only")
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    hidden, vocab = SHAPES[args.shape]
    device, dtype, mode = torch.device("cuda"), torch.bfloat16, "max-autotune-no-cudagraphs"
    if args.tiny:
        hidden, vocab, args.tokens = 64, 128, 32
        device, dtype, mode = torch.device("cpu"), torch.float32, "default"
    elif not torch.cuda.is_available():
        raise SystemExit("gemm_autotune needs a CUDA GPU (or --tiny on CPU)")
    for name, (out_f, in_f) in linears(hidden, vocab).items():
        if args.only and name not in args.only:
            continue
        x = torch.randn(args.tokens, in_f, device=device, dtype=dtype)
        w = torch.randn(out_f, in_f, device=device, dtype=dtype) / in_f**0.5
        tuned = torch.compile(F.linear, mode=mode, dynamic=False)
        flops = 2 * args.tokens * in_f * out_f
        rec = {"shape": args.shape, "linear": name, "tokens": args.tokens, "out": out_f, "in": in_f}
        for label, fn in (("cublas", F.linear), ("max_autotune", tuned)):
            ms = time_ms(lambda fn=fn, x=x, w=w: fn(x, w), 3, 20, device)
            rec[f"{label}_ms"] = ms
            rec[f"{label}_tflops"] = flops / (ms / 1e3) / 1e12
        rec["autotune_over_cublas"] = rec["cublas_ms"] / rec["max_autotune_ms"]
        emit(rec, args.json)


if __name__ == "__main__":
    main()
