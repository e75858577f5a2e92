"""benchmarks/moe_throughput.py: the device plan's overlays dry-run and fit one H100 by neox's
estimate, with 8 micro batches a step; moe1 and dense1 log the same FLOPs per token (active
ones); hf1 accumulates as neox's runs do; the profile's op parts are told apart by name, and
--tiny runs every path (deepy.py launches on 1 and 2 CPU ranks, transformers' OLMoE) end to
end."""

import argparse
import json

import pytest

from benchmarks import moe_throughput as bench
from tests.benchmarks.bench_helpers import ROOT, run_benchmark

DEVICE_RUNS = [r for r in bench.RUNS if bench.RUNS[r] is not None]
FIT_GIB = 70  # the plan's margin under an 80 GB H100 (79.6 GiB as torch reports it)


def device_args() -> argparse.Namespace:
    return argparse.Namespace(
        iters=20,
        num_layers=None,
        micro_batch=None,
        accum=None,
        vocab_file=None,
        tiny=False,
        profile=False,
        warmup_iters=1000,
    )


@pytest.mark.parametrize("run", DEVICE_RUNS)
def test_device_runs_dry_run_and_fit_an_h100(run, tmp_path, capsys, monkeypatch):
    """The overlays the GPU call launches pass deepy.py's dry run on their GPU count, with the
    layout asked, the flat engine, and an estimate under FIT_GIB."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(ROOT)
    sys.modules.pop("deepy", None)
    import deepy

    overlay = bench.run_config(device_args(), run, tmp_path, tmp_path / "tokens")
    assert deepy.main(["train.py", str(bench.MODEL_FILE), str(overlay), "--dry-run"]) == 0
    out = capsys.readouterr().out
    gpus = bench.RUNS[run]["num_gpus"]
    layout = f"layout: {gpus} GPU(s) = tp 1 x pp 1 x dp {gpus}; micro batch 1 x seq 4096"
    assert f"{layout}, accumulation 8," in out  # 32k tokens a GPU a step
    assert "flat_engine: true" in out
    header = next(line for line in out.splitlines() if "ZeRO-0" in line).split()
    total = next(line for line in out.splitlines() if line.startswith("total incl. CUDA"))
    column = next(i for i, name in enumerate(header) if name.endswith("*"))
    assert float(total.split()[4 + column]) < FIT_GIB, f"{run}: {total}"


def test_moe_and_dense_runs_log_the_same_active_flops():
    """neox's logged TFLOPS and MFU (ModelFlops) count moe1's active parameters: within its
    router's share of dense1's, whose MLP is top-8 x 1024 wide; the estimate's counts follow."""
    from neox.training.metrics import ModelFlops

    args = device_args()
    logged = {}
    for run in ("moe1", "dense1"):
        cfg, derived, _ = bench.load_run(args, run)
        logged[run] = ModelFlops(cfg, derived, "cpu").flops_per_token
    assert bench.load_run(args, "dense1")[0].model.shape.ffn_size == 8 * 1024
    assert 1 < logged["moe1"] / logged["dense1"] < 1.002
    moe, ep4 = bench.plan_estimate(args, "moe1"), bench.plan_estimate(args, "ep4")
    assert moe["flops_per_token"] == logged["moe1"]
    assert moe["total_params"] > 4 * moe["active_params"]  # 64 experts, 8 active
    assert ep4["expert_params_computed"] * 4 == moe["expert_params_held"]
    assert moe["all_to_all_gib_per_step"] == 0 < ep4["all_to_all_gib_per_step"]
    ep2 = bench.plan_estimate(args, "ep2")  # the 2-GPU kind's run: 32 experts a rank
    assert ep2["num_gpus"] == 2 and ep2["expert_params_computed"] * 2 == moe["expert_params_held"]


def test_accumulation_is_the_same_for_every_run():
    """--accum (else 32k tokens a GPU) reaches every neox run's config and hf1's step."""
    args = device_args()
    assert bench.accumulation(args) == 8
    args.micro_batch = 2
    assert bench.accumulation(args) == 4
    args.accum = 3
    for run in bench.RUNS:
        assert bench.load_run(args, run)[1].grad_accum == 3


def test_hf_step_accumulates_its_micro_batches(monkeypatch):
    """One hf1 step of `accum` micro batches hands its optimizer the mean of the micro batches'
    gradients (each loss / accum, as neox's engines weigh them), in one optimizer step."""
    import torch

    args = device_args()
    args.tiny = True
    cfg, _, vocab = bench.load_run(args, "hf1")
    handed = []
    # Record what the optimizer is given; without clipping (not linear in the gradients).
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: None)
    monkeypatch.setattr(
        torch.optim.AdamW,
        "step",
        lambda opt: handed.append([p.grad.clone() for g in opt.param_groups for p in g["params"]]),
    )

    def gradients(accum: int, i: int) -> list[torch.Tensor]:
        torch.manual_seed(0)  # the same initial weights every time
        step, _ = bench.hf_olmoe_step(cfg, 1, accum, vocab, torch.device("cpu"), False, None)
        step(i)
        return handed[-1]

    together = gradients(3, 0)  # micro batches 0, 1, 2
    alone = [gradients(1, j) for j in range(3)]  # one each
    assert len(handed) == 4  # one optimizer step per call
    for got, *parts in zip(together, *alone):
        torch.testing.assert_close(got, sum(parts) / 3, atol=1e-6, rtol=1e-5)
    assert not torch.equal(alone[0][0], alone[1][0])  # the micro batches differ


def test_profile_parts_are_told_apart_by_name():
    names = {
        "aten::_softmax": "router",
        "triton_per_fused__softmax_topk_0": "router",
        "aten::_log_softmax": None,  # the loss
        "LogSoftmaxBackward0": None,
        "cub::DeviceRadixSortOnesweepKernel": "dispatch",
        "aten::scatter_add_": "dispatch",
        "ncclDevKernel_ReduceScatter_Sum_bf16": None,  # the engine's gradients
        "c10d::allgather_": None,
        "ncclDevKernel_SendRecv": "all-to-all",
        "void cutlass::Kernel2<cutlass_80_GemmGrouped>": "grouped gemm",
        "aten::bmm": "grouped gemm",  # the padded batched matmul off CUDA
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": None,
        # The loss's fused kernels name an online softmax; the norms' and rotary's a cat/index.
        "triton_red_fused__log_softmax__to_copy__unsafe_view_prepare_softmax_online_view_1": None,
        "triton_red_fused__fused_rms_norm__to_copy__unsafe_view_add_cat_clone_index_mul": None,
        "triton_per_fused__softmax__to_copy_div_exp_logsumexp_sum_3": "router",
        "triton_per_fused_add_index_sum_view_5": "dispatch",
    }
    assert {n: bench.op_part(n) for n in names} == names


def test_a_kernel_is_named_after_the_aten_op_that_launched_it():
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::_grouped_mm", "args": {"External id": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "## Call CompiledFxGraph", "args": {"External id": 8}},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "cutlass::device_kernel<GemmUniversal>",
            "dur": 30,
            "args": {"External id": 7},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "triton_poi_fused_topk_2",
            "dur": 5,
            "args": {"External id": 8},
        },
    ]
    named = bench.kernel_names(events)
    assert named == [
        ("aten::_grouped_mm cutlass::device_kernel<GemmUniversal>", 30),
        ("triton_poi_fused_topk_2", 5),
    ]
    assert [bench.op_part(n) for n, _ in named] == ["grouped gemm", "router"]


@pytest.mark.slow
def test_tiny_runs_every_path(tmp_path):
    out = tmp_path / "results.jsonl"
    args = ["--tiny", "--profile", "--iters", "4", "--json", out, "--work-dir", tmp_path / "work"]
    r = run_benchmark("moe_throughput.py", *args, DS_ACCELERATOR="cpu")
    records = {rec["run"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    # Every run but ep2, which at the tiny shape is ep4's config (2 ranks, EP=2): no new path.
    assert set(records) == set(bench.RUNS) - {"ep2"}
    tiny = argparse.Namespace(**{**vars(device_args()), "tiny": True})
    assert bench.run_keys(tiny, "ep2") == bench.run_keys(tiny, "ep4")
    for rec in records.values():
        assert rec["exit_code"] == 0 and rec["tokens_per_s"] > 0
    assert records["ep4"]["num_gpus"] == 2 and records["hf1"]["compile"] is False
    assert "moe_expert_parallel_size: 2" in (tmp_path / "work" / "ep4.yml").read_text()
    # Every run accumulates TINY_ACCUM micro batches; neox's through the config's key.
    assert {rec["accum"] for rec in records.values()} == {bench.TINY_ACCUM}
    assert "gradient_accumulation_steps: 2" in (tmp_path / "work" / "moe1.yml").read_text()
    moe, dense, ep = records["moe1"]["profile"], records["dense1"]["profile"], records["ep4"]
    assert min(moe["router_ms"], moe["dispatch_ms"], moe["grouped gemm_ms"]) > 0
    assert dense["grouped gemm_ms"] == dense["router_ms"] == 0 == moe["all-to-all_ms"]
    assert ep["profile"]["all-to-all_ms"] > 0 and ep["all_to_all_gib_per_step"] > 0
    for line in ("moe1 / dense1 MFU", "moe1 / hf1 tokens/s", "ep4 per-GPU tokens/s / moe1"):
        assert line in r.stdout
    assert records["hf1"]["mfu"] > 0  # on TINY's nominal peak, as the neox runs' log
    assert "ep4 profile, of" in r.stdout


def test_a_run_cut_after_its_timed_steps_keeps_them(tmp_path, monkeypatch):
    """A launch that hit its time limit while the profiler wrote its traces (exit 124 after
    step 8) keeps the speed of its timed steps, said to have ended late; one cut before them
    is a failure with its log's tail."""
    args = argparse.Namespace(**{**vars(device_args()), "iters": 8, "first": 4, "profile": True})
    monkeypatch.setattr(bench, "run_config", lambda *a: tmp_path / "overlay.yml")
    monkeypatch.setattr(bench, "launch", lambda *a: (124, 150.0, 0))
    (tmp_path / "ep4.log").write_text("SIGTERM received\n")
    (tmp_path / "ep4").mkdir()
    metrics = tmp_path / "ep4" / "metrics.jsonl"

    def log_steps(last: int) -> None:
        lines = [
            {"step": s, "split": "train", "loss": 11.0, "tokens_per_s": 1000.0 * s,
             "step_time_s": 1.0 / s, "mfu": 0.3, "tflops_per_gpu": 300.0}
            for s in range(1, last + 1)
        ]  # fmt: skip
        metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))

    log_steps(8)
    rec = bench.measure(args, "ep4", tmp_path, tmp_path / "tokens")
    assert rec["exit_code"] == 124 and rec["ended_after_timed_steps"]
    assert rec["steps"] == "4-6" and rec["tokens_per_s"] == pytest.approx(5000.0)
    log_steps(5)
    rec = bench.measure(args, "ep4", tmp_path, tmp_path / "tokens")
    assert "tokens_per_s" not in rec and "SIGTERM" in rec["error"]


def test_timed_steps_lie_in_the_warmup_unless_told_otherwise():
    from neox.config import derive, load_config

    for warmup in (1000, 0):
        args = argparse.Namespace(**{**vars(device_args()), "warmup_iters": warmup})
        keys = bench.run_keys(args, "ep4") | {"data_path": None}
        cfg = load_config([str(bench.MODEL_FILE)], overrides=keys).config
        d = derive(cfg, 4, 50277)
        assert d.warmup_iters == warmup  # 0: full lr from step 1, as before
        if warmup:  # the last timed step is still far below the file's 4e-4
            assert d.lr_decay_iters > args.iters and d.lr * args.iters / d.warmup_iters < 1e-5


def test_rank_load_is_the_busiest_expert_groups_share_over_the_mean(tmp_path):
    """Two layers of 8 experts at step 2: one balanced (1.0), one whose first two experts take
    everything (4.0 over 4 groups): mean 2.5; steps outside first..last are left out."""
    even = {f"moe/0/load/{e}": 1 / 8 for e in range(8)}
    hot = {f"moe/1/load/{e}": (0.5 if e < 2 else 0.0) for e in range(8)}
    rows = [{"step": 1, **{k: 0.0 for k in even}, "moe/0/load/0": 1.0}, {"step": 2, **even, **hot}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.rank_load(metrics, 2, 2) == pytest.approx(2.5)
    assert bench.rank_load(metrics, 1, 1) == pytest.approx(4.0)
    assert bench.rank_load(metrics, 3, 4) is None
    # Over 2 groups (ep2's ranks): the hot layer's first group takes it all, 2.0; mean 1.5.
    assert bench.rank_load(metrics, 2, 2, ranks=2) == pytest.approx(1.5)
