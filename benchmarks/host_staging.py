#!/usr/bin/env python
"""The copy a save makes on the training thread (issue 35): per tensor into fresh host memory
(the path before neox/checkpoint/host_staging.py) against the reused staging buffer, and one
flat partition against the same bytes in many tensors.

python benchmarks/host_staging.py                 # CPU: 2 GB in 600 tensors
python benchmarks/host_staging.py --gb 17         # a GPU: Pythia-1.4B's fp32 state, pinned

Each line: seconds and GB/s of one copy of --gb (fp32) from the device (host memory on CPU), the
best of --repeat (the first staged copy, which allocates, once).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from neox.checkpoint.host_staging import HostStaging  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def staged(staging: HostStaging, tensors: list[torch.Tensor], device: torch.device) -> None:
    staging.reserve(sum(t.numel() for t in tensors), device)
    for t in tensors:
        staging.put(t)
    staging.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="fp32 bytes copied per save")
    p.add_argument("--tensors", type=int, default=600, help="tensors they are split into")
    p.add_argument("--repeat", type=int, default=3, help="the best of this many, but the first")
    p.add_argument("--json", help="append each result to this file")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    numel = int(args.gb * 1e9 / 4)
    each = numel // args.tensors
    flat = torch.randn(each * args.tensors, device=device)
    tensors = list(flat.split(each))  # views: the per-tensor copies read the same bytes
    staging = HostStaging()

    def best(fn) -> float:
        return min(timed(device, fn) for _ in range(args.repeat))

    first = timed(device, lambda: staged(staging, tensors, device))  # allocates (pins on CUDA)
    results = {
        "fresh per tensor": best(lambda: [t.to("cpu", torch.float32, copy=True) for t in tensors]),
        "staged, first save (allocates)": first,
        "staged, reused": best(lambda: staged(staging, tensors, device)),
        "staged, reused, one flat copy": best(lambda: staged(staging, [flat], device)),
    }
    for path, seconds in results.items():
        record = {
            "benchmark": "host_staging",
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "path": path,
            "gb": round(4 * flat.numel() / 1e9, 3),
            "tensors": args.tensors,
            "seconds": round(seconds, 4),
            "gb_per_s": round(4 * flat.numel() / 1e9 / seconds, 2),
        }
        common.emit(record, args.json)


if __name__ == "__main__":
    main()
