"""benchmarks/mfu_formulas.py: neox's logged MFU against Megatron's and torchtitan's formulas,
and the comparison in docs/benchmarks.md is the script's output."""

import importlib.util

import pytest

from tests.benchmarks.bench_helpers import ROOT

spec = importlib.util.spec_from_file_location("mfu_formulas", ROOT / "benchmarks/mfu_formulas.py")
mfu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mfu)


def test_formulas_agree_where_their_assumptions_hold():
    """An untied Pythia shape (multi-head attention, a 4h MLP): all three count the same model
    FLOPs, Megatron's to its ignored biases and norms."""
    cfg = mfu.model_of("configs/pythia/6-9B.yml")
    flops = mfu.compare(cfg, 50432)
    assert flops["torchtitan"] == flops["neox"]
    assert flops["megatron"] == pytest.approx(flops["neox"], rel=2e-3)


def test_where_they_part():
    """Full recomputation adds a fourth forward of the layers to Megatron's count only; a tied
    output layer drops out of torchtitan's N; GQA and a gated MLP shrink Megatron's."""
    pythia = mfu.model_of("configs/pythia/6-9B.yml")
    L, h, s, V = pythia.num_layers, pythia.hidden_size, pythia.seq_length, 50432
    layers = 24 * L * h * h * (1 + s / (6 * h))
    recomputed = mfu.compare(pythia, V, recompute=True)
    assert recomputed["megatron"] - mfu.compare(pythia, V)["megatron"] == pytest.approx(layers)
    assert recomputed["neox"] == mfu.compare(pythia, V)["neox"]

    tied = mfu.model_of("configs/qwen3/0-6B.yml")
    assert not tied.no_weight_tying
    V = mfu.vocab_of("configs/qwen3/0-6B.yml")
    flops = mfu.compare(tied, V)
    assert flops["neox"] - flops["torchtitan"] == 6 * V * tied.hidden_size

    llama = mfu.compare(mfu.model_of("configs/llama3/8B.yml"), 128256)
    assert llama["megatron"] < 0.96 * llama["neox"]


def test_docs_hold_the_scripts_tables():
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    for row in mfu.table() + mfu.shapes_table():
        assert row in docs, f"docs/benchmarks.md is stale: {row}"
