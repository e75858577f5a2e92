"""Where a profiled rank's device time went, from neox's profile trace (`profile: true`): how
long the GPU was busy, computing or communicating, how much of the communication no compute
hid, and how long it sat idle. It tells a slow kernel from a waiting GPU, which the operator
tables (profile/rank*.ops.txt: sums of kernel times) cannot.

    python benchmarks/timeline.py runs/.../profile/rank*_iters*.trace.json [--steps 2]

Per rank, milliseconds per profiled step: `span` (first kernel's start to last kernel's end),
`busy` (the union of every kernel, copy and memset on any stream), `compute` (of the kernels
that are not NCCL's), `comm` (of NCCL's), `exposed_comm` (NCCL time with no compute beside it),
`idle` (span - busy), and NCCL's time by collective (AllReduce, SendRecv: p2p and all-to-all,
AllGather, ReduceScatter, Broadcast). benchmarks/train_multi_gpu.py adds these to a profiled
run's record.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

Interval = tuple[float, float]
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
NCCL = re.compile(r"^nccl(?:Dev)?Kernel_(\w+?)(?:_|\(|$)")


def union(intervals: list[Interval]) -> list[Interval]:
    """The disjoint, sorted intervals that cover exactly what `intervals` cover."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """The length covered by both of two disjoint, sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(events: list[dict[str, Any]], steps: int = 2) -> dict[str, Any] | None:
    """The split above from a trace's events (chrome trace "X" events, microseconds); None when
    the trace has no device activity (CPU ranks)."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    if not device:
        return None
    comm, compute, kinds = [], [], {}
    for e in device:
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        m = NCCL.match(e["name"]) if e["cat"] == "kernel" else None
        if m:
            comm.append(span)
            kinds[m[1]] = kinds.get(m[1], 0.0) + span[1] - span[0]
        else:
            compute.append(span)
    busy, comm_u, compute_u = union(comm + compute), union(comm), union(compute)
    span = busy[-1][1] - busy[0][0]
    per_step = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    out = {
        "span_ms": per_step(span),
        "busy_ms": per_step(length(busy)),
        "compute_ms": per_step(length(compute_u)),
        "comm_ms": per_step(length(comm_u)),
        "exposed_comm_ms": per_step(length(comm_u) - overlap(comm_u, compute_u)),
        "idle_ms": per_step(span - length(busy)),
    }
    out |= {f"nccl_{k}_ms": per_step(v) for k, v in sorted(kinds.items())}
    return out


def trace_timeline(trace: Path, steps: int = 2) -> dict[str, Any] | None:
    return timeline(json.loads(trace.read_text())["traceEvents"], steps)


def rank_timelines(profile_dir: Path) -> dict[str, dict[str, Any]]:
    """{"rank<r>": its timeline} for each rank's trace in a run's profile/ folder that has
    device activity (none on CPU ranks)."""
    split = {t.name.split("_")[0]: trace_timeline(t) for t in profile_dir.glob("rank*.trace.json")}
    return {rank: split[rank] for rank in sorted(split) if split[rank]}


def timeline_lines(label: str, timelines: dict[str, dict[str, Any]]) -> list[str]:
    """One printed line per rank of a run's `rank_timelines`."""
    return [
        f"{label} {rank} ms a profiled step: "
        + ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in t.items())
        for rank, t in timelines.items()
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--steps", type=int, default=2, help="steps the trace covers")
    args = p.parse_args()
    for trace in args.traces:
        print(json.dumps({"trace": str(trace), **(trace_timeline(trace, args.steps) or {})}))


if __name__ == "__main__":
    main()
