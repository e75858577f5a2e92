"""benchmarks/fused_softmax.py --tiny --sweep on CPU through Triton's interpreter: every column
and the best-config lines, so the script the GPU run depends on cannot rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_sweep_prints_limits_variants_and_baselines():
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "benchmarks/fused_softmax.py", "--tiny", "--sweep", "--dtype", "bf16"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith("| 40 | bf16")]
    methods = [row[5] for row in rows]
    assert "triton rows=32,warps=4 (default)" in methods and "unfused torch" in methods
    assert len(methods) >= 3  # the default, at least one other variant, the torch path
    for row in rows:  # limits from the measured copy bandwidth (tiny here), then % of each
        assert float(row[4]) >= float(row[3]) >= 0 and float(row[7]) > 0
        assert row[8].endswith("%") and row[9].endswith("% |")
    assert "best at seq 40 bf16: NEOX_SOFTMAX_CONFIG='rows=" in r.stdout


def test_without_interpreter_tiny_says_what_to_set():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "benchmarks/fused_softmax.py", "--tiny"],
        cwd=ROOT,
        env=dict(env, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "TRITON_INTERPRET=1" in r.stderr
