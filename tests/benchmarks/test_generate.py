"""benchmarks/generate.py runs on CPU at the tiny shape, so it cannot rot."""

import subprocess
import sys

from tests.train_helpers import ROOT


def test_tiny_cpu_run_prints_the_table_with_matching_tokens():
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "generate.py"),
            "--tiny",
            "--device=cpu",
            "--dtype=fp32",
            "--batch-sizes",
            "1",
            "3",
            "--prompt-tokens=8",
            "--new-tokens=6",
            "--repeats=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    cells = [line.split("|") for line in r.stdout.splitlines() if line.startswith("| ")]
    rows = ["|".join(c) for c in cells if c[1].strip().isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "3"]
    # fp32 greedy: both engines pick the same tokens.
    assert all(row.rstrip(" |").endswith("100%") for row in rows), r.stdout
