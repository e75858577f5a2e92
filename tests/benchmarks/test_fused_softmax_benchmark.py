"""benchmarks/fused_softmax.py --tiny --sweep on CPU through Triton's interpreter: every column
and the best-config lines, so the script the GPU run depends on cannot rot."""

import pytest

from tests.benchmarks.bench_helpers import run_benchmark


def test_tiny_sweep_prints_limits_variants_and_baselines():
    pytest.importorskip("triton", reason="triton is not installed")
    r = run_benchmark(
        "fused_softmax.py", "--tiny", "--sweep", "--dtype", "bf16", TRITON_INTERPRET="1"
    )
    rows = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith("| 40 | bf16")]
    methods = [row[5] for row in rows]
    assert "triton rows=32,warps=4 (default)" in methods and "unfused torch" in methods
    assert len(methods) >= 3  # the default, at least one other variant, the torch path
    for row in rows:  # limits from the measured copy bandwidth (tiny here), then % of each
        assert float(row[4]) >= float(row[3]) >= 0 and float(row[7]) > 0
        assert row[8].endswith("%") and row[9].endswith("%")
        assert row[10:] == ["-", "- |"]  # device time from a CUDA graph: GPU runs only
    assert "best at seq 40 bf16: NEOX_SOFTMAX_CONFIG='rows=" in r.stdout


def test_without_interpreter_tiny_says_what_to_set():
    r = run_benchmark("fused_softmax.py", "--tiny", check=False, TRITON_INTERPRET="0")
    assert r.returncode == 1 and "TRITON_INTERPRET=1" in r.stderr
