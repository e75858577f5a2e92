"""neox/plan/attention_path.py: the kernel each layer type takes, that the model obeys it, and that
`deepy.py --dry-run` reports it for the shipped configs that select each path."""

import pytest
import torch

from neox.config import load_config
from neox.config.model import ModelConfig
from neox.model import attention as attention_module
from neox.model.attention import Attention
from neox.plan.attention_path import describe_attention_paths, select_attention_path
from tests.test_deepy import ROOT, deepy

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
FUSED = "scaled_upper_triang_masked_softmax_fusion"


def test_auto_picks_the_fastest_exact_kernel_per_layer_on_cuda():
    plain = ModelConfig(**TINY)
    assert select_attention_path(plain, "global", "cuda").impl == "flash"
    # The fusion flags ask for scale + causal mask + softmax fused: SDPA flash is that math.
    fused = ModelConfig(**TINY, **{FUSED: True})
    path = select_attention_path(fused, "global", "cuda")
    assert path.impl == "flash" and FUSED in path.reason and "float32" in path.reason
    assert select_attention_path(fused, "global", torch.device("cuda", 1)).impl == "flash"
    assert select_attention_path(fused, "flash", "cuda").impl == "flash"
    assert select_attention_path(fused, "global", "cpu").impl == "flash"
    masked = ModelConfig(**TINY, scaled_masked_softmax_fusion=True)
    assert select_attention_path(masked, "global", "cuda").impl == "flash"
    # The Triton softmax stays one key away, and explicit choices are obeyed.
    triton = ModelConfig(**TINY, attention_impl="triton", **{FUSED: True})
    assert select_attention_path(triton, "global", "cuda").impl == "triton"
    forced = ModelConfig(**TINY, attention_impl="torch", scaled_masked_softmax_fusion=True)
    path = select_attention_path(forced, "global", "cuda")
    assert path.impl == "torch" and path.reason == "attention_impl: torch"
    # Masks that rule out SDPA's flash kernel take FlexAttention on CUDA, SDPA elsewhere.
    packed = select_attention_path(plain, "global", "cuda", packed=True)
    assert packed.impl == "flex" and "packed documents" in packed.reason
    assert select_attention_path(plain, "global", "cpu", packed=True).impl == "flash"
    window = ModelConfig(**TINY, sliding_window_width=4)
    assert select_attention_path(window, "global", "cuda").impl == "flex"
    alibi = ModelConfig(**TINY, pos_emb="alibi")
    path = select_attention_path(alibi, "global", "cuda")
    assert path.impl == "flex" and "ALiBi" in path.reason
    dropout = ModelConfig(**TINY, pos_emb="alibi", sliding_window_width=4, attention_dropout=0.1)
    path = select_attention_path(dropout, "global", "cuda", packed=True)
    assert path.impl == "flash" and "attention_dropout=0.1" in path.reason
    flex = ModelConfig(**TINY, attention_impl="flex")
    assert select_attention_path(flex, "global", "cuda").impl == "flex"
    assert select_attention_path(flex, "global", "cpu").impl == "flash"  # no CPU backward
    with pytest.raises(ValueError, match="attention_impl: flex cannot run attention_dropout"):
        select_attention_path(
            ModelConfig(**TINY, attention_impl="flex", attention_dropout=0.1), "global"
        )


@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_impl": "torch"}, {"attention_impl": "triton"}, {FUSED: True}],
)
def test_the_model_runs_the_selected_path(monkeypatch, overrides):
    cfg = ModelConfig(**TINY, **overrides)
    attn = Attention(cfg)
    ran = []
    sdpa, scores = Attention._attend_sdpa, Attention._attend_scores
    monkeypatch.setattr(Attention, "_attend_sdpa", lambda s, *a: ran.append("flash") or sdpa(s, *a))
    monkeypatch.setattr(
        Attention,
        "_attend_scores",
        lambda s, *a, fused: (
            ran.append("triton" if fused else "torch") or scores(s, *a, fused=fused)
        ),
    )
    attn(torch.randn(2, 8, 32))
    assert ran == [select_attention_path(cfg, "global", "cpu").impl]
    assert attn.impl_cuda == select_attention_path(cfg, "global", "cuda").impl
    assert attention_module.select_attention_path is select_attention_path  # one decision


def test_describe_names_counts_windows_and_cpu_fallback():
    mixed = ModelConfig(
        **{**TINY, "num_layers": 4},
        attention_config=[[["global", "local"], 2]],
        sliding_window_width=8,
        attention_impl="triton",
    )
    lines = describe_attention_paths(mixed, cpu_ranks=True)
    assert lines[0].startswith("global x2: Triton fused softmax (why: attention_impl: triton)")
    assert "on these CPU ranks" not in lines[0]  # Triton's module falls back to its reference
    assert lines[1].startswith("local x2: Triton fused softmax")
    assert "sliding window 8" in lines[1]
    auto = ModelConfig(**{**mixed.model_dump(), "attention_impl": "auto", FUSED: True})
    lines = describe_attention_paths(auto, cpu_ranks=True, packed=True)
    assert lines[0].startswith("global x2: FlexAttention (block-sparse) (why: attention_impl auto")
    assert "attends within each packed document" in lines[0]
    assert "on these CPU ranks: torch SDPA (flash), this kernel needs CUDA" in lines[0]
    assert "on these CPU ranks" not in describe_attention_paths(auto, packed=True)[0]
    assert lines[1].startswith("local x2: FlexAttention (block-sparse)")
    assert "sliding window 8 + packed documents" in lines[1]
    plain = describe_attention_paths(auto)
    assert plain[0].startswith("global x2: torch SDPA (flash) (why: attention_impl auto")
    assert plain[1].startswith("local x2: FlexAttention (block-sparse) (why: attention_impl auto")


@pytest.mark.parametrize(
    "config,line",
    [
        ("configs/pythia/410M.yml", "flash x24: torch SDPA (flash)"),
        (
            "configs/20B.yml",
            "global x44: torch SDPA (flash) (why: attention_impl auto, `global` layers + "
            + FUSED
            + ": SDPA flash runs the same scale + causal mask + softmax",
        ),
        ("configs/llama2/7B.yml", "global x32: torch SDPA (flash)"),
        (
            "configs/mistral/7B.yml",
            "flash x32: FlexAttention (block-sparse) (why: attention_impl auto, sliding window",
        ),
    ],
)
def test_dry_run_reports_each_shipped_path(config, line, monkeypatch, capsys):
    cfg = load_config([str(ROOT / config)]).config.model
    assert any(text.startswith(line) for text in describe_attention_paths(cfg))
    if config == "configs/20B.yml":  # one real dry run; the others share its code
        section = dry_run_attention(monkeypatch, capsys, config)
        assert line in section


def dry_run_attention(monkeypatch, capsys, *configs: str) -> str:
    """The attention section of deepy.main's --dry-run, in this process (deepy.py's own
    process: the refused launch below)."""
    import deepy

    monkeypatch.chdir(ROOT)
    assert deepy.main(["train.py", *configs, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    return out.split("# attention per layer type", 1)[1].split("# estimate", 1)[0]


def test_local_layers_without_a_window_stop_a_launch(tmp_path):
    bad = tmp_path / "local.yml"
    bad.write_text('attention_config: [[["global", "local"], 1]]\n')
    r = deepy("train.py", "configs/tiny.yml", bad)
    assert r.returncode == 2 and "sliding_window_width is unset" in r.stderr


def test_dry_run_names_flex_for_packed_documents(tmp_path, monkeypatch, capsys):
    packed = tmp_path / "packed.yml"
    packed.write_text("reset_attention_mask: true\n")
    section = dry_run_attention(monkeypatch, capsys, "configs/tiny.yml", str(packed))
    assert "FlexAttention (block-sparse) (why: attention_impl auto, packed documents" in section
    assert "attends within each packed document" in section
