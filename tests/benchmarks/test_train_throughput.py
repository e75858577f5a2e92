"""benchmarks/train_throughput.py --tiny on CPU: neox's real step and HF's, so the script cannot rot."""

import json

from tests.benchmarks.bench_helpers import run_benchmark


def test_tiny_run_reports_both_implementations(tmp_path):
    out = tmp_path / "results.jsonl"
    r = run_benchmark(
        "train_throughput.py",
        *["--tiny", "--models", "160M", "--json", out, "--profile-dir", tmp_path / "prof"],
        *["--attention", "flash", "triton"],
        DS_ACCELERATOR="cpu",
    )
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
