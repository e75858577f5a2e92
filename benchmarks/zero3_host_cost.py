#!/usr/bin/env python
"""Host cost of one training step on one CPU rank: Python calls per step and graph breaks of the
per-block torch.compile, for the flat engine and DeepSpeed's ZeRO-3 (neox's defaults, or
DeepSpeed's own with --variants zero3_ds_defaults). The device is not involved: these counts are
what a GPU step pays on the host before its kernels run.

python benchmarks/zero3_host_cost.py --layers 4 --variants bf16 zero3 zero3_ds_defaults
python benchmarks/zero3_host_cost.py --layers 24 --no-compile

Results go in docs/benchmarks.md ("ZeRO-3 at one rank: what costs the time").
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(variant: str, layers: int, compile_backend: str | None, top: int = 0) -> str:
    """One variant in this process: ms/step, Python calls/step, graph breaks (and the `top`
    functions by calls a step, with their own time)."""
    import torch
    from torch._dynamo.utils import counters

    from benchmarks import common
    from benchmarks import train_throughput as tt

    extra = dict(tt.VARIANTS[variant])
    extra.update(common.TINY)
    extra.update(
        num_layers=layers,
        attention_config=[[["flash"], layers]],
        seq_length=16,
        max_position_embeddings=16,
        torch_compile=compile_backend is not None,
        torch_compile_backend=compile_backend or "inductor",
    )
    cfg = tt.neox_config("160M", 2, None, False, extra)
    step, run, close = tt.neox_step(cfg, torch.device("cpu"))
    for i in range(3):  # compiles, and ZeRO-3 records its trace
        step(i)
    tick = time.perf_counter()
    for i in range(3, 6):
        step(i)
    ms = 1000 * (time.perf_counter() - tick) / 3
    profile = cProfile.Profile()
    profile.enable()
    for i in range(6, 8):
        step(i)
    profile.disable()
    stats = pstats.Stats(profile)
    calls = stats.total_calls / 2
    breaks = sum(counters["graph_break"].values())
    close()
    engine = type(run.engine).__name__
    lines = []
    by_calls = sorted(stats.stats.items(), key=lambda kv: -kv[1][1])[:top]
    for (path, line, name), (_, ncalls, tottime, _, _) in by_calls:
        where = f"{Path(path).parent.name}/{Path(path).name}:{line}"
        lines.append(f"    {ncalls / 2:>9.0f} calls {1e3 * tottime / 2:>8.2f} ms  {name} ({where})")
    row = f"{variant:>18} {engine:>16} {layers:>6} {ms:>9.1f} {calls:>12.0f} {breaks:>7}"
    return "\n".join([row, *lines])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["bf16", "zero3", "zero3_ds_defaults"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--compile-backend", default="aot_eager", help="no C compiler needed")
    p.add_argument("--no-compile", action="store_true", help="eager blocks")
    p.add_argument("--top", type=int, default=0, help="list the N functions most called a step")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    backend = None if args.no_compile else args.compile_backend
    if args.one:  # a child: one variant, alone in its process (DeepSpeed patches torch globally)
        print(measure(args.one, args.layers, backend, args.top), flush=True)
        return 0
    print(
        f"{'variant':>18} {'engine':>16} {'layers':>6} {'ms/step':>9} {'calls/step':>12} {'breaks':>7}"
    )
    from benchmarks import common

    env = common.child_env(DS_ACCELERATOR="cpu")
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--one", variant, "--layers", str(args.layers)]
        cmd += ["--top", str(args.top)]
        cmd += ["--no-compile"] if args.no_compile else ["--compile-backend", args.compile_backend]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = out.stdout.splitlines()
        rows = [i for i, line in enumerate(lines) if line.strip().startswith(variant)]
        print("\n".join(lines[rows[-1] :]) if rows else f"{variant}: failed\n{out.stderr[-2000:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
