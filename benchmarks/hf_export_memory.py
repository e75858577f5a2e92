"""Peak host memory and time of tools/convert_to_hf.py exporting an 8B-shaped checkpoint.

Builds the Llama-3.1-8B-shaped HF directory of hf_import_memory.py (bf16 random weights in
transformers' 5GB shards), imports it with tools/convert_from_hf.py (`--tp 2`), records every
tensor's sha256 and deletes the HF directory (so the disk holds at most two copies of the
model), then runs `tools/convert_to_hf.py --max_shard_size 5GB --precision bf16` as the user does (a child
process) and reports its peak RSS against the largest shard it wrote. Every exported tensor's
sha256 is then checked against the original's.

    python benchmarks/hf_export_memory.py --work /tmp/hf8b-export [--layers 32] [--tp 2]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import emit  # noqa: E402
from benchmarks.hf_import_memory import build, child_peak_rss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tensor_digests(hf_dir: Path) -> dict[str, str]:
    """name -> sha256 of the tensor's bytes, for every tensor of hf_dir's safetensors files
    (read one tensor at a time from the file's mapping)."""
    from safetensors import safe_open

    out = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                digest = hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy())
                out[name] = f"{tensor.dtype} {tuple(tensor.shape)} {digest.hexdigest()}"
                del tensor
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="scratch directory (needs 2x model)")
    p.add_argument("--layers", type=int, default=32, help="blocks (Llama-3.1-8B has 32)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--max_shard_size", default="5GB")
    p.add_argument("--keep", action="store_true", help="keep the directories afterwards")
    p.add_argument("--json", help="append the result to this file")
    args = p.parse_args()
    hf_dir, neox_dir, out = args.work / "hf", args.work / "neox", args.work / "export"
    shutil.rmtree(args.work, ignore_errors=True)
    try:
        build(hf_dir, args.layers)
        importer = str(ROOT / "tools" / "convert_from_hf.py")
        child_peak_rss(
            [
                importer,
                "--input_dir",
                str(hf_dir),
                "--output_dir",
                str(neox_dir),
                "--tp",
                str(args.tp),
            ]
        )
        original = tensor_digests(hf_dir)
        shutil.rmtree(hf_dir)

        tool = str(ROOT / "tools" / "convert_to_hf.py")
        baseline, _ = child_peak_rss([tool, "--help"])  # the imports alone
        peak, seconds = child_peak_rss(
            [
                tool,
                "--input_dir",
                str(neox_dir),
                "--output_dir",
                str(out),
                "--max_shard_size",
                args.max_shard_size,
                "--precision",
                "bf16",
            ]
        )
        shards = sorted(out.glob("*.safetensors"))
        sizes = [s.stat().st_size for s in shards]
        t0 = time.perf_counter()
        exported = tensor_digests(out)
        if exported != original:
            differ = sorted(
                k for k in original.keys() | exported.keys() if original.get(k) != exported.get(k)
            )
            raise SystemExit(f"{len(differ)} tensors differ from the original, e.g. {differ[:3]}")
        checked = time.perf_counter() - t0
        emit(
            {
                "benchmark": "hf_export_memory",
                "layers": args.layers,
                "tp": args.tp,
                "max_shard_size": args.max_shard_size,
                "shards": len(shards),
                "model_bytes": sum(sizes),
                "largest_shard_bytes": max(sizes),
                "peak_rss_bytes": peak,
                "baseline_rss_bytes": baseline,
                "peak_over_largest_shard": round(peak / max(sizes), 3),
                "export_seconds": round(seconds, 1),
                "tensors_equal_to_original": len(original),
                "check_seconds": round(checked, 1),
            },
            args.json,
        )
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
