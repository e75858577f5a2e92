"""Initialisation is deterministic per name and layout-independent; meta builds allocate nothing."""

import math

import pytest
import torch

from neox.config.model import ModelConfig
from neox.model import build_model, init_parameter

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)


def test_same_seed_same_weights_other_seed_differs():
    cfg = ModelConfig(**TINY)
    a, b, c = build_model(cfg, 128, seed=5), build_model(cfg, 128, seed=5), build_model(cfg, 128, 6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), name


def test_names_get_different_values_and_model_matches_init_parameter():
    cfg = ModelConfig(**TINY, pos_emb="rotary", no_weight_tying=True)
    model = build_model(cfg, 128, seed=11)
    l0 = model.layers[0].attention.query_key_value.weight
    l1 = model.layers[1].attention.query_key_value.weight
    assert not torch.equal(l0, l1)
    for name, p in model.named_parameters():
        assert torch.equal(p, init_parameter(name, p.shape, cfg, 11)), name
    # A tensor-parallel rank takes rows of the full-shape init: the same numbers as TP=1.
    full = init_parameter("layers.1.mlp.dense_h_to_4h.weight", (256, 64), cfg, 11)
    torch.testing.assert_close(full[128:], model.layers[1].mlp.dense_h_to_4h.weight[128:])


@pytest.mark.parametrize(
    "method,std",
    [
        ("normal", 0.02),
        ("scaled_normal", 0.02 / math.sqrt(2 * 2)),
        ("small_init", math.sqrt(2 / (5 * 64))),
        ("wang_init", 2 / 2 / math.sqrt(64)),
    ],
)
def test_normal_methods_have_their_std(method, std):
    cfg = ModelConfig(**TINY, init_method=method, output_layer_init_method=method)
    w = init_parameter("layers.0.mlp.dense_h_to_4h.weight", (512, 512), cfg, 0)
    assert abs(w.std().item() - std) / std < 0.02
    assert abs(w.mean().item()) < std / 50


def test_output_layers_use_output_layer_init_method():
    cfg = ModelConfig(**{**TINY, "num_layers": 8})  # normal in, scaled_normal (std / 4) out
    model = build_model(cfg, 128)
    block = model.layers[0]
    inp, out = block.mlp.dense_h_to_4h.weight.std(), block.mlp.dense_4h_to_h.weight.std()
    assert 3.0 < inp / out < 5.0
    assert 3.0 < block.attention.query_key_value.weight.std() / block.attention.dense.weight.std()
    assert torch.all(block.attention.dense.bias == 0)
    assert torch.all(block.input_layernorm.weight == 1)


@pytest.mark.parametrize("method", ["xavier_uniform", "xavier_normal", "orthogonal"])
def test_other_methods(method):
    cfg = ModelConfig(**TINY, init_method=method)
    w = init_parameter("embed_in.weight", (64, 32), cfg, 0)
    assert torch.equal(w, init_parameter("embed_in.weight", (64, 32), cfg, 0))
    if method == "orthogonal":
        # gain sqrt(2): W^T W = 2 I for a tall matrix.
        torch.testing.assert_close(w.T @ w, 2 * torch.eye(32), atol=1e-4, rtol=1e-4)
    else:
        assert abs(w.std().item() - math.sqrt(2 / 96)) < 0.03


def test_meta_build_then_materialise():
    cfg = ModelConfig(**TINY, pos_emb="rotary")
    meta = build_model(cfg, 128, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.reset_parameters(seed=3)
    ref = build_model(cfg, 128, seed=3)
    ids = torch.randint(0, 128, (1, 8))
    torch.testing.assert_close(meta(ids), ref(ids))
