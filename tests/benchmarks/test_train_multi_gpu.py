"""benchmarks/train_multi_gpu.py --tiny: real deepy.py launches on 1 and 2 CPU ranks, metrics
read back into the table, so the script cannot rot."""

import json

import pytest

from tests.benchmarks.bench_helpers import run_benchmark


@pytest.mark.slow
def test_tiny_one_rank_and_dp2_runs_fill_the_table(tmp_path):
    out = tmp_path / "results.jsonl"
    args = ["--tiny", "--models", "410M", "--runs", "1gpu", "dp2", "--json", out]
    r = run_benchmark(
        "train_multi_gpu.py", *args, "--work-dir", tmp_path / "work", DS_ACCELERATOR="cpu"
    )
    records = {rec["run"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"1gpu", "dp2"}
    for rec in records.values():
        assert rec["exit_code"] == 0 and rec["steps"] == "3-6"
        assert rec["tokens_per_s"] > 0 and rec["peak_mem_gb"] > 0
    # Each run went through deepy.py: its own overlay, log and metrics.jsonl under the work dir.
    assert "num_gpus: 2" in (tmp_path / "work" / "410M_dp2.yml").read_text()
    assert (tmp_path / "work" / "410M_dp2" / "metrics.jsonl").stat().st_size > 0
    assert "410M: DP=2 ZeRO-1 / one GPU = " in r.stdout


def test_missing_tokenizer_is_named_before_any_launch(tmp_path):
    r = run_benchmark("train_multi_gpu.py", "--vocab-file", tmp_path / "no.json", check=False)
    assert r.returncode == 2 and "no.json not found" in r.stderr and "Traceback" not in r.stderr
