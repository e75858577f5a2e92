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


def bench_module():
    import importlib.util

    from tests.benchmarks.bench_helpers import ROOT

    path = ROOT / "benchmarks" / "train_multi_gpu.py"
    spec = importlib.util.spec_from_file_location("train_multi_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = bench_module()
PLANNED = [(m, r) for plan in ("4gpu", "8gpu", "long-context") for m, r in BENCH.PLANS[plan]]
H100_GIB = 79.6  # what torch reports of an 80 GB H100


def dry_run(model, run, tmp_path, capsys, monkeypatch, micro_batch=None) -> str:
    """deepy.py --dry-run's output for the run's exact overlay on num_gpus planned GPUs."""
    import argparse
    import sys

    from tests.benchmarks.bench_helpers import ROOT

    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(ROOT)
    sys.modules.pop("deepy", None)
    import deepy

    args = argparse.Namespace(
        micro_batch=micro_batch, iters=20, vocab_file=None, seq_length=None, tiny=False
    )
    overlay = BENCH.run_config(args, model, run, tmp_path, tmp_path / "tokens")
    assert deepy.main(["train.py", BENCH.MODELS[model][0], str(overlay), "--dry-run"]) == 0
    return capsys.readouterr().out


def estimate_gib(out: str) -> float:
    """The dry run's estimated GiB a GPU at the ZeRO stage it runs (the column marked *)."""
    header = next(line for line in out.splitlines() if "ZeRO-0" in line).split()
    total = next(line for line in out.splitlines() if line.startswith("total incl. CUDA"))
    column = next(i for i, name in enumerate(header) if name.endswith("*"))
    return float(total.split()[4 + column])


@pytest.mark.parametrize("model,run", PLANNED, ids=[f"{m}-{r}" for m, r in PLANNED])
def test_four_and_eight_gpu_runs_dry_run_and_fit_an_h100(model, run, tmp_path, capsys, monkeypatch):
    """The exact overlays of --plan 4gpu / 8gpu pass deepy.py's dry run (on num_gpus planned
    GPUs, as on the device), with the layout asked and an estimate under an H100's memory, so
    the first GPU call only has to run them."""
    out = dry_run(model, run, tmp_path, capsys, monkeypatch)
    keys = BENCH.RUNS[run]
    tp, pp = keys.get("model_parallel_size", 1), keys.get("pipe_parallel_size", 1)
    if run == "stock8":  # configs/20B.yml's own layout
        tp, pp = 2, 4
    gpus, cp = keys["num_gpus"], keys.get("context_parallel_size", 1)
    chunk = f"cp {cp} (a chunk of {32768 * (4 if '128k' in model else 1) // cp} tokens each) x "
    layout = f"tp {tp} x pp {pp} x {chunk if cp > 1 else ''}dp {gpus // tp // pp // cp};"
    assert f"layout: {gpus} GPU(s) = {layout}" in out
    assert estimate_gib(out) < H100_GIB, f"{model} {run}: {estimate_gib(out)} GiB"


# How the flat engine reduces gradients in the overlap plan's runs (the dry run's engine line),
# by the run's name after dp4 / cp4.
DURING = "all-reduced during the backward in buckets of up to"
REDUCTION = {
    "_no_overlap": "reduce-scattered after the backward (overlap_comm off)",
    "": f"{DURING} 500,000,000 elements (overlap_comm)",
    "_bucket50m": f"{DURING} 50,000,000 elements (overlap_comm)",
}
OVERLAP_RUNS = [(m, r) for m, r in BENCH.PLANS["overlap"] if r != "1gpu"]


@pytest.mark.parametrize("model,run", OVERLAP_RUNS, ids=[f"{m}-{r}" for m, r in OVERLAP_RUNS])
def test_overlap_runs_reduce_gradients_as_named(model, run, tmp_path, capsys, monkeypatch):
    """dp4 and cp4 keep the Pythia file's overlap_comm (their overlays set no ZeRO section);
    the A/B runs merge theirs over it: all on the flat engine."""
    out = dry_run(model, run, tmp_path, capsys, monkeypatch)
    engine = next(line for line in out.splitlines() if line.startswith("engine:"))
    assert engine.startswith("engine: neox's flat engine at ZeRO 0, 1")
    assert engine.endswith(f"; gradients: {REDUCTION[run[3:]]}")


CHUNK_RUNS = [
    (m, r)
    for p in ("cp-chunks", "cp-accum", "cp-chunks2")
    for m, r in BENCH.PLANS[p]
    if r.startswith(("cp4", "cp2"))
]


@pytest.mark.parametrize("model,run", CHUNK_RUNS, ids=[f"{m}-{r}" for m, r in CHUNK_RUNS])
def test_cp_chunk_runs_name_their_head_groups(model, run, tmp_path, capsys, monkeypatch):
    """multi_gpu.sh cp-chunks, cp-accum and cp-chunks2: cp4 and cp2 and their runs in head
    groups (and at 8 micro batches a step) pass the dry run at their CP size with the
    accumulation asked, each layer's attention line naming the exchange's groups (1.4B's 16
    heads: 4 a rank at CP=4, 8 at CP=2)."""
    out = dry_run(model, run, tmp_path, capsys, monkeypatch)
    cp = BENCH.RUNS[run]["context_parallel_size"]
    assert f"layout: {cp} GPU(s) = tp 1 x pp 1 x cp {cp}" in out
    accumulation = BENCH.RUNS[run].get("gradient_accumulation_steps", 1)
    assert f"accumulation {accumulation}," in out
    chunks = BENCH.RUNS[run].get("context_parallel_chunks", 1)
    grouped = f"the exchange in {chunks} groups of {16 // cp // chunks} query head"
    attention = [line for line in out.splitlines() if f"context parallel over {cp} ranks" in line]
    assert attention and all((grouped in line) == (chunks > 1) for line in attention), out


def test_profiled_steps_stay_out_of_the_mean():
    """--profile slows the last two steps: the mean ends before them where timed steps remain."""
    import argparse

    def last(iters, first, profile):
        return BENCH.timed_last(argparse.Namespace(iters=iters, first=first, profile=profile))

    assert last(12, 6, False) is None
    assert last(12, 6, True) == 10
    assert last(8, 7, True) is None  # nothing left before the profiled steps: all are kept


SPLIT = BENCH.PLANS["split20b"]


@pytest.mark.parametrize("model,run", SPLIT, ids=[f"{m}-{r}" for m, r in SPLIT])
def test_split20b_runs_ask_one_layout_cost_each(model, run, tmp_path, capsys, monkeypatch):
    """multi_gpu.sh split20b: configs/20B.yml at 8 layers on one GPU, PP=2 alone, TP=2 alone,
    each at the 33.5% run's micro batch 2 x 8, under an H200's memory by the estimate."""
    out = dry_run(model, run, tmp_path, capsys, monkeypatch)
    keys = BENCH.RUNS[run]
    tp, pp = keys.get("model_parallel_size", 1), keys.get("pipe_parallel_size", 1)
    assert f"= tp {tp} x pp {pp} x dp 1; micro batch 2 x seq 2048, accumulation 8" in out
    assert estimate_gib(out) < 139, f"{model} {run}: {estimate_gib(out)} GiB"


def test_the_default_table_stays_the_two_gpu_one():
    """A run added for a named plan must not join the default 2-GPU table unasked (extra runs
    are listed in the benchmark's *_EXTRA tuples)."""
    assert {r for _, r in BENCH.DEFAULT_PLAN} == {
        "1gpu",
        "dp2",
        "tp2",
        "tp2_compile",
        "pp2",
        "dp2_zero3",
        "1gpu_ds_engine",
        "1gpu_ds_engine_accum8",
    }


H200_PLANS = [(m, r) for p in ("pipe-sends", "zero3-mb8", "speed-2gpu") for m, r in BENCH.PLANS[p]]


@pytest.mark.parametrize("model,run", H200_PLANS, ids=[f"{m}-{r}" for m, r in H200_PLANS])
def test_h200_only_runs_dry_run_on_an_h200(model, run, tmp_path, capsys, monkeypatch):
    """multi_gpu.sh pipe-sends, zero3-mb8 and speed-2gpu: each run's layout and micro batch as
    named, DeepSpeed given whole pipeline sends where asked, fp8 where asked, and an estimate
    under an H200's memory."""
    out = dry_run(model, run, tmp_path, capsys, monkeypatch)
    keys = BENCH.RUNS[run]
    gpus = keys["num_gpus"]
    tp, pp = keys.get("model_parallel_size", 1), keys.get("pipe_parallel_size", 1)
    micro = keys.get("train_micro_batch_size_per_gpu", BENCH.MICRO_BATCH[model])
    accumulation = keys["gradient_accumulation_steps"]
    layout = f"tp {tp} x pp {pp} x dp {gpus // tp // pp}; micro batch {micro} x seq 2048, "
    assert f"layout: {gpus} GPU(s) = {layout}accumulation {accumulation}," in out
    assert ('"pipe_partitioned": false' in out) == run.endswith("whole_sends")
    assert estimate_gib(out) < 139, f"{model} {run}: {estimate_gib(out)} GiB"


KEYS20B = [(m, r) for p in ("keys20b-1gpu", "keys20b") for m, r in BENCH.PLANS[p]]


@pytest.mark.parametrize("model,run", KEYS20B, ids=[f"{m}-{r}" for m, r in KEYS20B])
def test_keys20b_runs_take_the_files_keys_where_named(model, run, tmp_path, capsys, monkeypatch):
    """multi_gpu.sh keys20b: at micro batch 2 x 8, the `_file` runs keep configs/20B.yml's fp16,
    recompute and per-layer sync (issue 34's 33.5% run), `_ckpt` adds recompute to the
    benchmark's bf16 and `_sync` the sync; the plain run has none of them."""
    out = dry_run(model, run, tmp_path, capsys, monkeypatch, micro_batch=2)
    file_keys = run.endswith("_file")
    precision = "fp16" if file_keys else "bf16"
    assert f"micro batch 2 x seq 2048, accumulation 8, {precision};" in out
    recompute = file_keys or "_ckpt" in run
    assert f"activation checkpointing {'on' if recompute else 'off'})" in out
    sync = file_keys or run.endswith("_sync")
    assert f'"synchronize_checkpoint_boundary": {str(sync).lower()},' in out
    assert estimate_gib(out) < 79.6, f"{model} {run}: {estimate_gib(out)} GiB"
