"""tools/estimate.py run from the repo root on shipped configs; the fit check it shares with deepy."""

import re
import subprocess
import sys
from pathlib import Path

from neox.config import derive, load_config
from neox.plan.estimate import train_flops_per_token
from neox.plan.memory import GiB, estimate_memory, training_shape
from neox.plan.report import fit_warning, recompute_note, tokens_per_second

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args):
    return subprocess.run(
        [sys.executable, "tools/estimate.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_pythia_160m_report():
    r = run_tool("configs/pythia/160M.yml", "--gpus", "8", "--mfu", "0.5", "--gpu", "a100")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "162,322,944 total" in out  # HF pythia-160m num_parameters()
    assert "85,056,000 non-embedding" in out
    assert "tp 1 x pp 1 x dp 8" in out
    # The table: one row per part, four ZeRO stages, the configured stage (1) starred.
    assert "ZeRO-1*" in out
    assert "engine: DeepSpeed's at ZeRO 0, 1, 2, 3 (the flat engine does not cover fp16" in out
    weights = re.search(r"^weights\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert weights, out
    stage0, _, _, stage3 = (float(x) for x in weights.groups())
    assert stage3 < stage0 / 4  # ZeRO-3 shards fp16 weights over 8 ranks
    # Throughput: 0.5 x 312 TFLOPS x 8 GPUs / FLOPs per token.
    cfg = load_config([str(ROOT / "configs/pythia/160M.yml")]).config
    expected = 0.5 * 312e12 * 8 / train_flops_per_token(cfg.model, 50304)
    shown = float(re.search(r"([\d,]+) tokens/s", out).group(1).replace(",", ""))
    assert abs(shown - expected) <= 1


def test_conf_dir_and_peak_override():
    r = run_tool("-d", "configs", "pythia/410M.yml", "--peak-tflops", "100")
    assert r.returncode == 0, r.stderr
    assert "of 100 TFLOPS/GPU" in r.stdout


def test_bad_input_is_one_clear_error():
    r = run_tool("configs/pythia/160M.yml", "--mfu", "40")
    assert r.returncode == 2 and "--mfu=40.0 must be in (0, 1]" in r.stderr
    r = run_tool("configs/20B.yml", "--gpus", "3")  # tp 2 x pp 4 needs a multiple of 8
    assert r.returncode == 2 and "model_parallel_size" in r.stderr and "Traceback" not in r.stderr
    r = run_tool("configs/no_such.yml")
    assert r.returncode == 2 and "no_such.yml" in r.stderr and "Traceback" not in r.stderr


def test_tokens_per_second_scales_with_gpus_and_mfu():
    cfg = load_config([str(ROOT / "configs/pythia/1-4B.yml")]).config
    one = tokens_per_second(cfg, 50304, 1, 989.0, 0.4)
    assert tokens_per_second(cfg, 50304, 8, 989.0, 0.2) == __import__("pytest").approx(4 * one)


def test_fit_warning_names_the_fixes():
    cfg = load_config([str(ROOT / "configs/pythia/1-4B.yml")]).config
    derived = derive(cfg, 8, 50277)
    need = estimate_memory(cfg.model, training_shape(cfg, derived, 50304)).total
    assert fit_warning(cfg, derived, 50304, need + GiB) is None
    warning = fit_warning(cfg, derived, 50304, need // 2)
    assert warning is not None
    assert f"{need / GiB:.1f} GiB" in warning and "train_micro_batch_size_per_gpu" in warning
    # Without checkpointing, compiled blocks (the GPU default) can recompute a part first.
    plain = load_config(
        [str(ROOT / "configs/pythia/1-4B.yml")], overrides={"checkpoint_activations": False}
    ).config
    warning = fit_warning(plain, derive(plain, 8, 50277), 50304, GiB)
    assert "activation_memory_budget: 0.75" in warning and "checkpoint_activations: true" in warning
    budget = load_config(
        [str(ROOT / "configs/pythia/1-4B.yml")],
        overrides={"checkpoint_activations": False, "activation_memory_budget": 0.75},
    ).config
    warning = fit_warning(budget, derive(budget, 8, 50277), 50304, GiB)
    assert "activation_memory_budget" not in warning and "checkpoint_activations: true" in warning


def test_recompute_note_only_where_the_run_fits_without_checkpointing():
    """configs/20B.yml cut to 12 layers at TP2 x PP2 (issue 34's run) needs ~31.5 GiB a GPU
    without recompute: noted on an 80 GB GPU, not on a 32 GB one, and never when the file's
    checkpoint_activations is off."""
    cut = {"num_layers": 12, "pipe_parallel_size": 2, "train_micro_batch_size_per_gpu": 2}
    cfg = load_config([str(ROOT / "configs/20B.yml")], overrides=cut).config
    derived = derive(cfg, 4, 50277)
    off = cfg.model_copy(
        update={"training": cfg.training.model_copy(update={"checkpoint_activations": False})}
    )
    need = estimate_memory(cfg.model, training_shape(off, derived, 50432)).total
    note = recompute_note(cfg, derived, 50432, 80 * GiB)
    assert note is not None and f"({need / GiB:.1f} GiB)" in note and "80.0 GiB" in note
    assert "checkpoint_activations: false" in note
    assert recompute_note(cfg, derived, 50432, 32 * GiB) is None  # 31.5 > 0.85 x 32
    assert recompute_note(off, derived, 50432, 80 * GiB) is None


def test_bf16_report_names_the_flat_engine_and_compiled_loss(tmp_path):
    """Pythia in bf16 on 8 GPUs: neox's flat engine at ZeRO 0-1 (no buckets, no fp32 gradient
    copy at the step), DeepSpeed's at 2-3; the loss compiled, as on a GPU by default."""
    overlay = tmp_path / "bf16.yml"
    overlay.write_text("precision: bfloat16\nfp16: {enabled: false}\n")
    r = run_tool("configs/pythia/160M.yml", str(overlay), "--gpus", "8")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert (
        "engine: neox's flat engine at ZeRO 0, 1; DeepSpeed's at ZeRO 2, 3; loss: compiled" in out
    )

    def row(label):
        found = re.search(rf"^{label}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
        return [float(x) for x in found.groups()]

    assert row("ZeRO gradient buckets")[:2] == [0.0, 0.0] and row("ZeRO gradient buckets")[2] > 0
    assert row("optimizer-step fp32 grads")[:2] == [0.0, 0.0]


def test_engine_line_says_why_deepspeed_runs():
    from neox.config import load_dict
    from neox.plan.report import describe_engines

    def line(world, **overrides):
        cfg = load_dict({"precision": "bfloat16", **overrides})
        return describe_engines(cfg, derive(cfg, world, 512), 512)

    assert line(1, flat_engine=False, lm_loss_chunk_size=64) == (
        "engine: DeepSpeed's at ZeRO 0, 1, 2, 3 (flat_engine: false); "
        "loss: chunked, 64 tokens at a time"
    )
    tp2 = line(2, model_parallel_size=2)
    assert "(the flat engine does not cover tensor or pipeline parallelism)" in tp2
    # The vocab-parallel loss, compiled with the output layer (torch_compile on a GPU).
    assert tp2.endswith("loss: compiled with the output layer (torch_compile), bf16 logits")
    one_rank = line(1)  # ZeRO-2 without a second rank to partition over: still the flat engine
    assert one_rank.startswith("engine: neox's flat engine at ZeRO 0, 1, 2; DeepSpeed's at ZeRO 3")
