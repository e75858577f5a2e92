"""GPTNeoX against transformers' GPTNeoX and Llama, parameter counts, causality, backward."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from neox.config import load_config
from neox.config.model import ModelConfig
from neox.hf.mapping import hf_config_for, to_hf_state_dict
from neox.model import build_model, count_parameters, lm_loss

VOCAB, PADDED = 100, 128
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)

NEOX_CONFIGS = {
    "pythia": dict(pos_emb="rotary", rotary_pct=0.25, gpt_j_residual=True, no_weight_tying=True),
    "pythia_full_rotary": dict(pos_emb="rotary", rotary_pct=1.0, gpt_j_residual=True),
    "sequential": dict(pos_emb="rotary", rotary_pct=0.25, no_weight_tying=True),
    "sequential_full_rotary_tied": dict(pos_emb="rotary", rotary_pct=1.0),
    "gelu_tanh_no_attn_bias": dict(
        pos_emb="rotary", activation="gelu", bias_gelu_fusion=True, use_bias_in_attn_linear=False
    ),
    "gpt_j_tied": dict(pos_emb="rotary", gpt_j_residual=True, gpt_j_tied=True),
}
LLAMA_BASE = dict(
    pos_emb="rotary",
    norm="rmsnorm",
    rms_norm_epsilon=1e-5,
    activation="swiglu",
    use_bias_in_attn_linear=False,
    use_bias_in_mlp=False,
    no_weight_tying=True,
)
LLAMA_CONFIGS = {
    "llama": LLAMA_BASE,
    "llama_gqa": {**LLAMA_BASE, "num_kv_heads": 2},
    "llama_mqa_tied_geglu": {
        **LLAMA_BASE,
        "num_kv_heads": 1,
        "no_weight_tying": False,
        "activation": "geglu",
    },
}

# Options the HF classes cannot express, each a short real run (count, backward, causality).
FEATURES = {
    "default_learned": {},
    "opt_offset": dict(opt_pos_emb_offset=2),
    "alibi": dict(pos_emb="alibi"),
    "no_pos": dict(pos_emb="none"),
    "scalenorm_relu": dict(norm="scalenorm", activation="relu", pos_emb="rotary"),
    "layernorm_nobias_silu": dict(use_bias_in_norms=False, activation="silu"),
    "qk_norm_gqa": dict(use_qk_layernorm=True, num_kv_heads=2, pos_emb="rotary"),
    "sliding_window": dict(sliding_window_width=4, pos_emb="rotary"),
    "local_global": dict(
        attention_config=[[["global", "local"], 1]], sliding_window_width=3, pos_emb="alibi"
    ),
    "geglu_gated_bias": dict(activation="geglu", intermediate_size=96, mlp_multiple_of=8),
    "torch_impl_dropout": dict(attention_impl="torch", hidden_dropout=0.1, attention_dropout=0.1),
    "triton_impl": dict(attention_impl="triton", pos_emb="rotary", num_kv_heads=2),
    **NEOX_CONFIGS,
    **LLAMA_CONFIGS,
}


def make_cfg(overrides: dict) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Large random weights, norms and biases included, so a wrong mapping shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(p + 0.2 * noise if p.dim() == 1 else 0.3 * noise)
    return model.eval()


def to_hf(tmp_path, model, cfg, arch):
    """Write our weights as an HF checkpoint and load it with transformers, as a user would."""
    save_file(
        to_hf_state_dict(model.state_dict(), cfg, VOCAB, arch), tmp_path / "model.safetensors"
    )
    (tmp_path / "config.json").write_text(json.dumps(hf_config_for(cfg, VOCAB, arch)))
    cls = GPTNeoXForCausalLM if arch == "gpt_neox" else LlamaForCausalLM
    return cls.from_pretrained(tmp_path, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", NEOX_CONFIGS)
def test_logits_match_hf_gpt_neox(tmp_path, name):
    cfg = make_cfg(NEOX_CONFIGS[name])
    model = randomize(build_model(cfg, PADDED), seed=7)
    hf = to_hf(tmp_path, model, cfg, "gpt_neox")
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        ours = model(ids)[..., :VOCAB]
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_logits_match_hf_llama(tmp_path, name):
    cfg = make_cfg(LLAMA_CONFIGS[name])
    model = randomize(build_model(cfg, PADDED), seed=8)
    hf = to_hf(tmp_path, model, cfg, "llama")
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        ours = model(ids)[..., :VOCAB]
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_position_ids_and_padding_mask_match_hf(tmp_path):
    """Left padding: the real tokens' logits equal HF's with the same mask and positions."""
    cfg = make_cfg(NEOX_CONFIGS["pythia"])
    model = randomize(build_model(cfg, PADDED), seed=3)
    hf = to_hf(tmp_path, model, cfg, "gpt_neox")
    ids = torch.randint(0, VOCAB, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = model(ids, position_ids=pos, attention_mask=mask)[..., :VOCAB]
        theirs = hf(ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-4, rtol=1e-4)
    # The padded row's real tokens equal the same tokens run alone, unpadded.
    with torch.no_grad():
        alone = model(ids[1:, 4:])[..., :VOCAB]
    torch.testing.assert_close(ours[1, 4:], alone[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FEATURES)
def test_parameter_count_is_analytic(name):
    cfg = make_cfg(FEATURES[name])
    model = build_model(cfg, PADDED)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg, PADDED)


@pytest.mark.parametrize("name", ["pythia", "pythia_full_rotary", "sequential_full_rotary_tied"])
def test_parameter_count_matches_hf_gpt_neox(name):
    cfg = make_cfg(NEOX_CONFIGS[name])
    hf = GPTNeoXForCausalLM(GPTNeoXConfig(**hf_config_for(cfg, PADDED, "gpt_neox")))
    assert hf.num_parameters() == count_parameters(cfg, PADDED)


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_parameter_count_matches_hf_llama(name):
    cfg = make_cfg(LLAMA_CONFIGS[name])
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_for(cfg, PADDED, "llama")))
    assert hf.num_parameters() == count_parameters(cfg, PADDED)


@pytest.mark.parametrize("name", FEATURES)
def test_causal_backward_and_finite_grads(name):
    cfg = make_cfg(FEATURES[name])
    model = build_model(cfg, PADDED, seed=1).eval()
    ids = torch.randint(0, VOCAB, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (ids[:, 8:] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(ids), model(changed)
    # A future token never changes earlier logits; it does change its own.
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, 8:], b[:, 8:])

    model.train()
    loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    assert model.embed_in.weight.grad.abs().sum() > 0


def test_loss_mask_averages_unmasked_tokens():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    mask = torch.zeros(2, 5)
    mask[0, :3] = 1
    expected = torch.nn.functional.cross_entropy(logits[0, :3], labels[0, :3])
    torch.testing.assert_close(lm_loss(logits, labels, mask), expected)
    torch.testing.assert_close(
        lm_loss(logits, labels),
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()),
    )


def test_tied_model_has_no_output_matrix():
    tied = build_model(make_cfg({}), PADDED)
    untied = build_model(make_cfg(dict(no_weight_tying=True)), PADDED)
    assert tied.embed_out is None and "embed_out.weight" not in tied.state_dict()
    assert untied.embed_out.weight.shape == (PADDED, 32)
    x = torch.randn(1, 3, 32)
    torch.testing.assert_close(
        tied.head(x), tied.final_layer_norm(x) @ tied.embed_in.weight.T, atol=1e-6, rtol=1e-6
    )


SHIPPED = sorted(str(p) for p in (Path(__file__).parents[2] / "configs").rglob("*.yml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.split("configs/")[-1])
def test_shipped_configs_build_on_meta(path):
    cfg = load_config([path]).config.model
    model = build_model(cfg, 50304, device="meta")
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg, 50304)
    if path.endswith("pythia/160M.yml"):
        assert count_parameters(cfg, 50304) == 162_322_944  # HF pythia-160m num_parameters()
