"""Tiny transformers models of every family neox converts, each with its distinguishing features
on (GQA, each RoPE scaling, sliding windows shorter than the test sequences, QK-norm, biases, a
head_dim other than hidden / heads, tied and untied embeddings, experts with and without
renormalised top-k weights), built locally from a config with
random weights (no download), and the neox model holding the same weights.

Shared by the parity tests of tests/model, tests/checkpoint, tests/inference and tests/parallel.
"""

import json

import torch

from neox.inference.generator import left_pad

VOCAB, PADDED = 100, 128  # HF's vocabulary; neox pads it (the padding must never leak back)
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
# Test sequences run to 52 tokens: past every window (5-7 keys) and every original RoPE length
# (16), so each feature shows in the logits.
FAMILIES = {
    "gpt_neox_partial_dynamic_untied": (
        "gpt_neox",
        dict(
            use_parallel_residual=True,
            tie_word_embeddings=False,
            max_position_embeddings=16,
            rope_parameters=dict(
                rope_type="dynamic", rope_theta=10000.0, factor=2.0, partial_rotary_factor=0.5
            ),
        ),
    ),
    "llama3_gqa": (
        "llama",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama_linear_biases_tied": (
        "llama",
        dict(
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),
    ),
    "llama_dynamic_mqa": (
        "llama",
        dict(
            num_key_value_heads=1,
            max_position_embeddings=16,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        ),
    ),
    "mistral_window": (
        "mistral",
        dict(num_key_value_heads=2, sliding_window=6, tie_word_embeddings=False),
    ),
    "qwen2_window_yarn_tied": (
        "qwen2",
        dict(
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,  # layer 0 full, layer 1 windowed
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen3_qknorm_head_dim_yarn": (
        "qwen3",
        dict(
            num_key_value_heads=2,
            head_dim=16,  # 4 heads x 16 = 64 != hidden 32, as Qwen3-0.6B
            attention_bias=True,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1000000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=16.0,
                beta_slow=2.0,
                mscale=1.0,
                mscale_all_dim=0.5,
            ),
        ),
    ),
    "qwen3_window_linear_tied": (
        "qwen3",
        dict(
            num_key_value_heads=4,
            head_dim=8,  # transformers' Qwen3 default is 128
            use_sliding_window=True,
            sliding_window=7,
            max_window_layers=0,  # every layer windowed
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        ),
    ),
    "mixtral_window_experts": (
        "mixtral",
        dict(
            num_key_value_heads=2,
            sliding_window=6,
            num_local_experts=4,
            num_experts_per_tok=2,  # the top two renormalised, always in Mixtral
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe_qknorm_unnormalised_tied": (
        "qwen3_moe",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=False,  # the top-k softmax weights as they are (OLMoE's rule too)
            tie_word_embeddings=True,
        ),
    ),
    "qwen2_moe_shared_expert": (
        "qwen2_moe",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,  # two experts' width, behind a sigmoid gate
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "olmoe_projection_qknorm": (
        "olmoe",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            pad_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,
        ),
    ),
}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Large random weights, norms and biases included, so a wrong mapping shows in the logits
    and greedy choices are far from ties."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(p + 0.2 * noise if p.dim() == 1 else 0.3 * noise)
    return model.eval()


def hf_model(name: str, seed: int = 0):
    """(arch, config.json dict, transformers model in eval mode) for family case `name`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, overrides = FAMILIES[name]
    base = dict(BASE)
    if arch == "gpt_neox":
        base["layer_norm_eps"] = base.pop("rms_norm_eps")
    config = AutoConfig.for_model(arch, **{**base, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return arch, json.loads(config.to_json_string()), randomize(model, seed)


def neox_pair(name: str, seed: int = 0):
    """(arch, ModelConfig, neox GPTNeoX with the HF weights, HF model)."""
    from neox.config.model import ModelConfig
    from neox.hf.importer import neox_model_keys
    from neox.hf.mapping import from_hf_state_dict
    from neox.model import build_model

    arch, config, hf = hf_model(name, seed)
    cfg = ModelConfig(**neox_model_keys(config))
    model = build_model(cfg, PADDED)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg, PADDED, arch))
    return arch, cfg, model.eval(), hf


def token_ids(batch: int = 2, length: int = 52, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int, pad: int = 0, device: str = "cpu"):
    """transformers' greedy generate of exactly `new_tokens` per left-padded prompt (no EOS
    stop), as lists of ids: the reference neox's decoding must equal."""
    ids, mask = left_pad(prompts, pad, device)
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask.long(),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=None,
    )
    return out[:, ids.shape[1] :].tolist()
