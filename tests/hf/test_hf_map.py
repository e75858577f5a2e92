"""The neox <-> HF name table and reshapes: round trips, vocab padding, what cannot be exported."""

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from neox.config.model import ModelConfig
from neox.hf.mapping import (
    check_exportable,
    from_hf_state_dict,
    fuse_qkv,
    hf_config_for,
    split_qkv,
    to_hf_state_dict,
)
from neox.model import build_model

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, pos_emb="rotary")
LLAMA = dict(
    norm="rmsnorm", activation="swiglu", use_bias_in_attn_linear=False, use_bias_in_mlp=False
)
CASES = {
    "gpt_neox_untied": (
        "gpt_neox",
        dict(gpt_j_residual=True, rotary_pct=0.25, no_weight_tying=True),
    ),
    "gpt_neox_tied": ("gpt_neox", dict()),
    "gpt_neox_gpt_j_tied": ("gpt_neox", dict(gpt_j_residual=True, gpt_j_tied=True)),
    "llama_gqa": ("llama", dict(**LLAMA, num_kv_heads=2, no_weight_tying=True)),
    "llama_biases_tied": ("llama", dict(LLAMA, use_bias_in_attn_linear=True, use_bias_in_mlp=True)),
}
VOCAB, PADDED = 100, 128


@pytest.mark.parametrize("case", CASES)
def test_ours_to_hf_to_ours_is_identity(case):
    arch, overrides = CASES[case]
    cfg = ModelConfig(**TINY, **overrides)
    sd = build_model(cfg, PADDED, seed=2).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, cfg, VOCAB, arch), cfg, PADDED, arch)
    assert back.keys() == sd.keys()
    for name, t in sd.items():
        if name in ("embed_in.weight", "embed_out.weight"):
            # Padded rows are dropped on export and come back as zeros.
            assert torch.equal(back[name][:VOCAB], t[:VOCAB])
            assert torch.all(back[name][VOCAB:] == 0)
        else:
            assert torch.equal(back[name], t), name


@pytest.mark.parametrize("case", CASES)
def test_hf_to_ours_to_hf_is_identity(case):
    """From a transformers model's own state dict (in-memory names), through ours, and back."""
    arch, overrides = CASES[case]
    cfg = ModelConfig(**TINY, **overrides)
    torch.manual_seed(0)
    if arch == "gpt_neox":
        hf = GPTNeoXForCausalLM(GPTNeoXConfig(**hf_config_for(cfg, VOCAB, arch)))
    else:
        hf = LlamaForCausalLM(LlamaConfig(**hf_config_for(cfg, VOCAB, arch)))
    hf_sd = hf.state_dict()
    ours = from_hf_state_dict(hf_sd, cfg, PADDED, arch)
    model = build_model(cfg, PADDED)
    model.load_state_dict(ours)  # strict: every parameter present with its shape
    again = to_hf_state_dict(model.state_dict(), cfg, VOCAB, arch)
    on_disk = {
        k.replace("lm_head.", "embed_out.") if arch == "gpt_neox" else k: v
        for k, v in hf_sd.items()
    }
    if not cfg.no_weight_tying:
        on_disk.pop("embed_out.weight" if arch == "gpt_neox" else "lm_head.weight", None)
    assert again.keys() == on_disk.keys()
    for name, t in on_disk.items():
        assert torch.equal(again[name], t), name


def test_qkv_split_and_fuse_are_inverse_and_grouped():
    nh, nkv, hs = 4, 2, 3
    w = torch.arange((nh + 2 * nkv) * hs * 5.0).view(-1, 5)
    q, k, v = split_qkv(w, nh, nkv, hs)
    assert q.shape == (nh * hs, 5) and k.shape == v.shape == (nkv * hs, 5)
    assert torch.equal(fuse_qkv(q, k, v, nh, nkv), w)
    # Group 0 holds query heads 0 and 1, then key 0, then value 0 (rows of hs each).
    assert torch.equal(w[: 2 * hs], q[: 2 * hs])
    assert torch.equal(w[2 * hs : 3 * hs], k[:hs])
    assert torch.equal(w[3 * hs : 4 * hs], v[:hs])
    b = torch.randn((nh + 2 * nkv) * hs)
    assert torch.equal(fuse_qkv(*split_qkv(b, nh, nkv, hs), nh, nkv), b)


def test_pythia_buffers_are_ignored_and_tied_hf_fills_untied_output():
    cfg = ModelConfig(**TINY, no_weight_tying=True)
    hf = GPTNeoXForCausalLM(
        GPTNeoXConfig(
            **hf_config_for(cfg.model_copy(update={"no_weight_tying": False}), VOCAB, "gpt_neox")
        )
    )
    hf_sd = {k: v for k, v in hf.state_dict().items() if not k.startswith("lm_head")}
    hf_sd["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)
    hf_sd["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    hf_sd["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    ours = from_hf_state_dict(hf_sd, cfg, PADDED, "gpt_neox")
    torch.testing.assert_close(ours["embed_out.weight"], ours["embed_in.weight"])
    build_model(cfg, PADDED).load_state_dict(ours)


def test_unknown_keys_are_named():
    cfg = ModelConfig(**TINY)
    with pytest.raises(KeyError, match="gpt_neox.layers.0.attention.rope_scale"):
        from_hf_state_dict(
            {"gpt_neox.layers.0.attention.rope_scale.weight": torch.ones(1)},
            cfg,
            PADDED,
            "gpt_neox",
        )


@pytest.mark.parametrize(
    "arch,overrides,words",
    [
        ("gpt_neox", dict(pos_emb="alibi"), "pos_emb='alibi'"),
        ("gpt_neox", dict(num_kv_heads=2), "GQA"),
        ("gpt_neox", dict(norm="rmsnorm"), "layernorm"),
        ("llama", dict(LLAMA, rotary_pct=0.5), "rotary_pct"),
        ("llama", dict(LLAMA, gpt_j_residual=True), "sequential"),
        ("llama", dict(), "rmsnorm"),
        ("bert", dict(), "unknown HF architecture"),
    ],
)
def test_inexpressible_configs_are_refused_by_name(arch, overrides, words):
    cfg = ModelConfig(**{**TINY, **overrides})
    with pytest.raises(ValueError, match=words):
        check_exportable(cfg, arch)
