#!/usr/bin/env python
"""One rank's state file written and checksummed (issue 35): the way before
(`safetensors.torch.save_file`, then the manifest's sha256 reading the file back) against one
pass (neox/checkpoint/hashed_write.py: the sha256 of the bytes as they are written, in a second
thread).

python benchmarks/hashed_write.py                  # 2 GB of fp32 in 600 tensors, under /tmp
python benchmarks/hashed_write.py --gb 17 --dir D  # Pythia-1.4B's state on one rank, on disk D

Each line: seconds of one save of --gb, the best of --repeat (the two ways alternate, each file
removed before the next save). Neither fsyncs (the save fsyncs once at publish), so the write
lands in the page cache when it fits, as a save's does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from neox.checkpoint.hashed_write import save_hashed  # noqa: E402
from neox.checkpoint.manifest import file_digest  # noqa: E402


def before(tensors: dict[str, torch.Tensor], path: Path) -> tuple[str, float]:
    """save_file, then the checksum read back; (digest, seconds of the write alone)."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    save_file(tensors, path)
    written = time.perf_counter() - start
    return file_digest(path), written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="fp32 bytes written per save")
    p.add_argument("--tensors", type=int, default=600, help="tensors they are split into")
    p.add_argument("--repeat", type=int, default=3, help="the best of this many")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the files are written")
    p.add_argument("--json", help="append each result to this file")
    args = p.parse_args(argv)
    each = int(args.gb * 1e9 / 4) // args.tensors
    flat = torch.randn(each * args.tensors)
    tensors = {f"fp32/t{i}": t for i, t in enumerate(flat.split(each))}
    gb = 4 * flat.numel() / 1e9
    path = Path(args.dir) / "hashed_write_bench.safetensors"
    best = {"before: save_file": 1e9, "before: save_file + file_digest": 1e9, "one pass": 1e9}
    try:
        for _ in range(args.repeat):
            start = time.perf_counter()
            old, written = before(tensors, path)
            total = time.perf_counter() - start
            path.unlink()
            start = time.perf_counter()
            new = save_hashed(tensors, path)
            one_pass = time.perf_counter() - start
            assert new == file_digest(path), "one pass wrote another file than it hashed"
            path.unlink()
            for key, seconds in zip(best, (written, total, one_pass)):
                best[key] = min(best[key], seconds)
    finally:
        path.unlink(missing_ok=True)
    for way, seconds in best.items():
        record = {
            "benchmark": "hashed_write",
            "way": way,
            "bytes": 4 * flat.numel(),
            "gb": round(gb, 3),
            "tensors": args.tensors,
            "seconds": round(seconds, 3),
            "gb_per_s": round(gb / seconds, 2),
        }
        common.emit(record, args.json)


if __name__ == "__main__":
    main()
