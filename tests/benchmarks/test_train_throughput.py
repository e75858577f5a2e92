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


def test_tiny_long_context_rows(tmp_path):
    """--long-context: the reference row and a packed-documents row (reset_attention_mask),
    each through neox's real step, with its ratio to the first."""
    out = tmp_path / "long.jsonl"
    r = run_benchmark(
        "train_throughput.py",
        *["--tiny", "--models", "160M", "--json", out],
        *["--long-context", "2k", "8k_packed", "--doc-length", "32"],
        DS_ACCELERATOR="cpu",
    )
    records = {rec["long_context"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"2k", "8k_packed"}
    assert records["2k"]["seq"] == 64 and records["8k_packed"]["seq"] == 256
    assert records["8k_packed"]["neox_overrides"]["reset_attention_mask"] is True
    assert records["8k_packed"]["doc_length"] == 32 and records["2k"]["doc_length"] is None
    assert all(rec["tokens_per_s"] > 0 for rec in records.values())
    assert "8k_packed    256   1   no" in r.stdout


def test_tiny_grad_accum_counts_every_micro_batch(tmp_path):
    """--grad-accum: neox and HF each take that many micro batches per optimizer step, and
    tokens/s counts all of them."""
    out = tmp_path / "accum.jsonl"
    run_benchmark(
        "train_throughput.py",
        *["--tiny", "--models", "160M", "--impls", "neox", "hf", "--grad-accum", "3"],
        *["--json", out],
        DS_ACCELERATOR="cpu",
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {rec["impl"] for rec in records} == {"neox", "hf"}
    for rec in records:
        assert rec["grad_accum"] == 3
        tokens = rec["tokens_per_s"] * rec["step_ms"] / 1000
        assert abs(tokens - rec["micro_batch"] * 3 * rec["seq"]) < 1e-6 * tokens
    neox = next(rec for rec in records if rec["impl"] == "neox")
    assert neox["neox_overrides"]["gradient_accumulation_steps"] == 3
