"""benchmarks/train_throughput.py --tiny on CPU: neox's real step and HF's, so the script cannot rot."""

import json

import pytest

from tests.benchmarks.bench_helpers import run_benchmark


def test_tiny_run_reports_both_implementations(tmp_path):
    """neox and HF at the tiny shape; with --grad-accum, each takes that many micro batches per
    optimizer step, and tokens/s counts all of them."""
    out = tmp_path / "results.jsonl"
    r = run_benchmark(
        "train_throughput.py",
        *["--tiny", "--models", "160M", "--json", out, "--profile-dir", tmp_path / "prof"],
        *["--attention", "flash", "triton", "--grad-accum", "3"],
        DS_ACCELERATOR="cpu",
    )
    records = {
        (rec["impl"], rec["attention"]): rec
        for rec in map(json.loads, out.read_text().splitlines())
    }
    # neox once per attention kernel (Triton's falls back to its torch reference on CPU).
    assert set(records) == {("neox", "flash"), ("neox", "triton"), ("hf", "sdpa")}
    overrides = {"attention_impl": "triton", "gradient_accumulation_steps": 3}
    assert records[("neox", "triton")]["neox_overrides"] == overrides
    for rec in records.values():
        assert rec["tokens_per_s"] > 0 and rec["tflops"] > 0 and rec["seq"] == 64
        assert rec["grad_accum"] == 3
        tokens = rec["tokens_per_s"] * rec["step_ms"] / 1000
        assert abs(tokens - rec["micro_batch"] * 3 * rec["seq"]) < 1e-6 * tokens
    assert "160M: neox (flash) / hf =" in r.stdout
    assert "160M: neox triton / flash attention =" in r.stdout
    assert (tmp_path / "prof" / "neox_triton_160M.trace.json").stat().st_size > 0
    assert {"busy_ms", "ops_ms", "kinds_ms", "top_kernels"} <= set(
        records[("neox", "flash")]["kernels"]
    )


def test_kernels_are_told_apart_by_name():
    """The profile's kinds: cuBLAS/CUTLASS matmuls, flash attention, and inductor's Triton
    kernels named after their aten ops (torchao's amax is max(abs), its cast clamps)."""
    from benchmarks.train_throughput import kernel_kind

    assert kernel_kind("triton_red_fused_abs_max_0") == "fp8 amax (triton)"
    assert kernel_kind("triton_red_fused_abs_add_max_native_layer_norm_3") == "fp8 amax (triton)"
    assert kernel_kind("triton_poi_fused__to_copy_clamp_mul_reciprocal_1") == "fp8 cast (triton)"
    assert kernel_kind("triton_per_fused_native_layer_norm_2") == "other triton"
    assert kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kernel_kind("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128") == "gemm"
    assert (
        kernel_kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    )
    assert kernel_kind("void multi_tensor_apply_kernel<TensorListMetadata<4>>") == "optimizer"
    assert kernel_kind("Memcpy DtoD (Device -> Device)") == "copy"
    assert kernel_kind("void at::native::reduce_kernel<512, 1>") == "other (eager)"


def test_tiny_long_context_rows(tmp_path):
    """--long-context: the reference row and a packed-documents row (reset_attention_mask),
    each through neox's real step, with its ratio to the first."""
    out = tmp_path / "long.jsonl"
    r = run_benchmark(
        "train_throughput.py",
        *["--tiny", "--models", "160M", "--json", out],
        *["--long-context", "2k", "8k_packed", "--doc-length", "32"],
        *["--neox-overrides", '{"gradient_accumulation_steps": 2}'],
        DS_ACCELERATOR="cpu",
    )
    records = {rec["long_context"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"2k", "8k_packed"}
    assert records["2k"]["seq"] == 64 and records["8k_packed"]["seq"] == 256
    assert records["8k_packed"]["neox_overrides"]["reset_attention_mask"] is True
    assert records["8k_packed"]["doc_length"] == 32 and records["2k"]["doc_length"] is None
    assert all(rec["tokens_per_s"] > 0 for rec in records.values())
    assert "8k_packed    256   1   no" in r.stdout
    # A step is gradient_accumulation_steps micro batches, and its tokens count so.
    first = records["2k"]
    assert first["grad_accum"] == 2 and first["micro_batch"] == 4  # LONG_CONTEXT's 2k row
    assert first["tokens_per_s"] == pytest.approx(4 * 2 * 64 / (first["step_ms"] / 1e3))


def test_inductor_options_reach_inductor_config():
    """--inductor key=value (dotted keys into sub-configs, True/False and JSON values) sets
    torch._inductor.config for the runs that follow."""
    import torch._inductor.config as inductor

    from benchmarks.common import set_inductor_options

    # inductor's own patch restores these keys on exit (pytest's monkeypatch would delete
    # them from the config module on undo).
    keys = {"coordinate_descent_tuning": False, "triton.unique_kernel_names": False}
    with inductor.patch({**keys, "combo_kernels": False}):
        set_inductor_options(
            ["coordinate_descent_tuning=True", "triton.unique_kernel_names=True", "combo_kernels=1"]
        )
        assert inductor.coordinate_descent_tuning is True
        assert inductor.triton.unique_kernel_names is True
        assert inductor.combo_kernels == 1
        with pytest.raises(AttributeError):
            set_inductor_options(["triton.no_such_option_here.x=1"])
