"""neox/plan/estimate.py: parameter counts against built models, whole and per tp/pp rank."""

import json

import pytest

from neox.config.model import ModelConfig
from neox.model import build_model
from neox.plan.estimate import (
    blocks_per_stage,
    count_parameters,
    embedding_parameters,
    stage_tensor_sizes,
)
from neox.plan.memory import block_activation_bytes
from tests.estimate_helpers import count_rank_parameters
from tests.parallel.rank_helpers import run_ranks

TINY = dict(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16)
# Shapes whose per-rank split differs: tied/untied head, learned positions, GQA, gated MLP,
# biases, qk norms, parallel residual with one norm.
RANK_MODELS = {
    "pythia_untied": dict(pos_emb="rotary", gpt_j_residual=True, no_weight_tying=True),
    "tied_learned": dict(pos_emb="learned"),
    "llama_gqa": dict(
        pos_emb="rotary",
        norm="rmsnorm",
        activation="swiglu",
        num_kv_heads=2,
        use_bias_in_attn_linear=False,
        use_bias_in_mlp=False,
        no_weight_tying=True,
    ),
    "qk_norm_gpt_j_tied": dict(
        use_qk_layernorm=True, gpt_j_residual=True, gpt_j_tied=True, pos_emb="rotary"
    ),
}
VOCAB = 128


# The whole-model count of every shipped config is checked in tests/model/test_gpt.py.


@pytest.mark.parametrize("name", RANK_MODELS)
def test_embedding_parameters_equal_built_model(name):
    cfg = ModelConfig(**{**TINY, **RANK_MODELS[name]})
    model = build_model(cfg, VOCAB, seed=0, device="meta")
    embeddings = sum(p.numel() for n, p in model.named_parameters() if n.startswith("embed_"))
    assert embedding_parameters(cfg, VOCAB) == embeddings
    assert count_parameters(cfg, VOCAB) == sum(p.numel() for p in model.parameters())


def test_blocks_per_stage_as_deepspeed_partitions():
    from deepspeed.runtime.utils import partition_balanced

    for layers, pp in ((3, 2), (10, 4), (12, 4), (44, 6)):
        weights = [0] + [1] * layers + [0, 0]  # embedding, blocks, final norm, head
        bounds = partition_balanced(weights, pp)
        real = [sum(weights[bounds[i] : bounds[i + 1]]) for i in range(pp)]
        assert blocks_per_stage(layers, pp) == real


@pytest.fixture(scope="module")
def rank_counts(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks") / "counts.json"
    models = {
        name: {"model": {**TINY, **fields}, "vocab": VOCAB} for name, fields in RANK_MODELS.items()
    }
    run_ranks(count_rank_parameters, 4, models, str(out))
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", RANK_MODELS)
def test_rank_counts_equal_tp_and_pipeline_builds(rank_counts, name):
    """Every rank of real tp=2 and tp=2 x pp=2 builds holds what stage_tensor_sizes says."""
    cfg = ModelConfig(**{**TINY, **RANK_MODELS[name]})
    for rank_row in rank_counts:
        row = rank_row[name]
        assert row["tp2"] == sum(stage_tensor_sizes(cfg, VOCAB, tp=2))
        stage = row["tp2pp2_stage"]
        assert row["tp2pp2"] == sum(stage_tensor_sizes(cfg, VOCAB, tp=2, pp=2, stage=stage))
    # Each tp rank saves its shards of the attention and MLP activations, whole norm inputs.
    saved = block_activation_bytes(cfg, "global", cfg.seq_length, 2, 4, tp=2) * cfg.num_layers
    for rank_row in rank_counts:
        assert rank_row[name]["tp2_activations"] == pytest.approx(saved, rel=0.02)
    largest = max(r[name]["tp2pp2"] for r in rank_counts)
    assert count_parameters(cfg, VOCAB, tp=2, pp=2) == largest


def test_attention_flops_count_the_keys_a_query_sees():
    """12 x query width x keys per layer: head_dim widens it, a window shorter than the
    sequence (N + 1 keys) narrows it, on its layers only."""
    from neox.config.model import ModelConfig
    from neox.plan.estimate import flops_parameters, train_flops_per_token

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64)
    for extra, keys in [
        ({}, 64 + 64),
        (dict(sliding_window_width=7), 8 + 8),
        (dict(sliding_window_width=7, attention_config=[[["global", "local"], 1]]), 64 + 8),
        (dict(sliding_window_width=100), 64 + 64),
    ]:
        cfg = ModelConfig(**base, **extra)
        attention = train_flops_per_token(cfg, 128) - 6 * flops_parameters(cfg, 128)
        assert attention == 12 * 32 * keys
    wide = ModelConfig(**base, head_dim=16)
    assert train_flops_per_token(wide, 128) - 6 * flops_parameters(wide, 128) == 12 * 64 * 128
