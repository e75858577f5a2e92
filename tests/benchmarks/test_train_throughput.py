"""benchmarks/train_throughput.py --tiny on CPU: neox's real step and HF's, so the script cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_reports_both_implementations(tmp_path):
    out = tmp_path / "results.jsonl"
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "benchmarks/train_throughput.py", "--tiny", "--models", "160M"]
        + ["--json", str(out), "--profile-dir", str(tmp_path / "prof")]
        + ["--attention", "flash", "triton"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = {
        (rec["impl"], rec["attention"]): rec
        for rec in map(json.loads, out.read_text().splitlines())
    }
    # neox once per attention kernel (Triton's falls back to its torch reference on CPU).
    assert set(records) == {("neox", "flash"), ("neox", "triton"), ("hf", "sdpa")}
    assert records[("neox", "triton")]["neox_overrides"] == {"attention_impl": "triton"}
    for rec in records.values():
        assert rec["tokens_per_s"] > 0 and rec["tflops"] > 0 and rec["seq"] == 64
    assert "160M: neox (flash) / hf =" in r.stdout
    assert "160M: neox triton / flash attention =" in r.stdout
    assert (tmp_path / "prof" / "neox_triton_160M.trace.json").stat().st_size > 0
