"""benchmarks/estimate_memory.py --tiny: the real setup trains a tiny shape and prints the table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_shape_trains_and_prints_the_table(tmp_path):
    out = tmp_path / "results.json"
    r = subprocess.run(
        [sys.executable, "benchmarks/estimate_memory.py", "--tiny", "--steps", "2", "--json", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "est alloc" in r.stdout and "tiny" in r.stdout
    (result,) = json.loads(out.read_text())
    assert result["loss"] > 0  # two real steps ran
    est = result["estimate"]
    assert est["peak_allocated"] >= est["weights"] + est["optimizer_states"] > 0
    # The estimate assumed the engine build_run built (on CPU: no compile, so an eager loss).
    assert result["engine_built"] == "FlatEngine"
    assert result["assumed"] == "flat engine, eager loss"
    assert "flat engine, eager loss / FlatEngine" in r.stdout
