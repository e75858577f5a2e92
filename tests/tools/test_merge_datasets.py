"""tools/merge_datasets.py run from the repo root on real shards."""

import subprocess
import sys
from pathlib import Path

import numpy as np

from neox.data.indexed import IndexedDataset, IndexedDatasetBuilder

ROOT = Path(__file__).resolve().parents[2]


def write(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    b.finalize(f"{prefix}.idx")


def run_tool(*args):
    return subprocess.run(
        [sys.executable, "tools/merge_datasets.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_merge_directory_in_name_order(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write(shards / "s1", [[[4, 5]]])
    write(shards / "s0", [[[1, 2], [3]], [[9]]])
    res = run_tool("--input", str(shards), "--output-prefix", str(tmp_path / "all"))
    assert res.returncode == 0, res.stderr
    assert "merged 2 datasets" in res.stderr and "3 documents" in res.stderr
    ds = IndexedDataset(str(tmp_path / "all"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [9], [4, 5]]
    assert ds.doc_idx.tolist() == [0, 2, 3, 4]
    # Refuses to overwrite unless asked.
    res = run_tool("--input", str(shards), "--output-prefix", str(tmp_path / "all"))
    assert res.returncode == 1 and "already exists" in res.stderr


def test_dtype_mismatch_and_missing_half_are_refused(tmp_path):
    write(tmp_path / "a", [[[1]]])
    write(tmp_path / "b", [[[70000]]], np.int32)
    res = run_tool(
        "--input", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--output-prefix", str(tmp_path / "m")
    )
    assert res.returncode == 1 and "different token dtypes" in res.stderr
    assert not (tmp_path / "m.bin").exists() and not (tmp_path / "m.idx").exists()
    (tmp_path / "b.idx").unlink()
    res = run_tool(
        "--input", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--output-prefix", str(tmp_path / "m")
    )
    assert res.returncode == 1 and "b.idx not found" in res.stderr
