"""neox <-> Hugging Face state-dict and config conversion for GPTNeoXForCausalLM, the Llama
family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) and its
mixture-of-experts kin (MixtralForCausalLM, Qwen3MoeForCausalLM: experts in hf_moe.py).

The name table below is used in both directions; the only reshapes are the fused QKV split for
the Llama family's separate q/k/v projections and the padded vocabulary rows (dropped on export,
zeros on import). Llama-family weights are taken in HF's own format: HF's rotate-half rotary is
ours, so no q/k permutation is needed (that permutation only exists between Meta's and HF's
files). Both state-dict functions work on any subset of the keys holding whole layers (a shard,
or one layer at a time), so a converter may stream.
"""

from __future__ import annotations

import re
from typing import Any, Union

import torch

from neox.checkpoint.writer import VOCAB_MODULES, resize_vocab
from neox.config.model import ModelConfig
from neox.hf.moe_mapping import (
    ATTENTION_ARCH,
    MOE_ARCHS,
    MOE_KEYS,
    ExpertStacker,
    experts_to_hf,
    hf_moe_config,
    hub_name,
    moe_problems,
)
from neox.model.mlp import activation_name
from neox.plan.attention_path import layer_window

ARCHS = ("gpt_neox", "llama", "mistral", "qwen2", "qwen3", *MOE_ARCHS)
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", *MOE_ARCHS)
# The names users give the families (convert_to_hf.py --architecture, hf_architecture).
ARCH_NAMES = {
    "gpt_neox": "neox",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe",
    "olmoe": "olmoe",
}
HF_CLASSES = {
    "gpt_neox": "GPTNeoXForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}

HFName = Union[str, tuple[str, str, str]]

_LLAMA_KEYS: dict[str, HFName] = {
    "embed_in": "model.embed_tokens",
    "layers.{}.input_layernorm": "model.layers.{}.input_layernorm",
    "layers.{}.post_attention_layernorm": "model.layers.{}.post_attention_layernorm",
    "layers.{}.attention.query_key_value": (
        "model.layers.{}.self_attn.q_proj",
        "model.layers.{}.self_attn.k_proj",
        "model.layers.{}.self_attn.v_proj",
    ),
    "layers.{}.attention.dense": "model.layers.{}.self_attn.o_proj",
    "layers.{}.mlp.gate": "model.layers.{}.mlp.gate_proj",
    "layers.{}.mlp.dense_h_to_4h": "model.layers.{}.mlp.up_proj",
    "layers.{}.mlp.dense_4h_to_h": "model.layers.{}.mlp.down_proj",
    "final_layer_norm": "model.norm",
    "embed_out": "lm_head",
}

# neox module path -> HF module path, "{}" standing for the layer index; the parameter suffix
# (.weight / .bias) carries over. A tuple is (q, k, v) modules fused into our query_key_value.
HF_KEYS: dict[str, dict[str, HFName]] = {
    "gpt_neox": {
        "embed_in": "gpt_neox.embed_in",
        "layers.{}.input_layernorm": "gpt_neox.layers.{}.input_layernorm",
        "layers.{}.post_attention_layernorm": "gpt_neox.layers.{}.post_attention_layernorm",
        "layers.{}.attention.query_key_value": "gpt_neox.layers.{}.attention.query_key_value",
        "layers.{}.attention.dense": "gpt_neox.layers.{}.attention.dense",
        "layers.{}.mlp.dense_h_to_4h": "gpt_neox.layers.{}.mlp.dense_h_to_4h",
        "layers.{}.mlp.dense_4h_to_h": "gpt_neox.layers.{}.mlp.dense_4h_to_h",
        "final_layer_norm": "gpt_neox.final_layer_norm",
        "embed_out": "embed_out",
    },
    "llama": _LLAMA_KEYS,
    "mistral": _LLAMA_KEYS,
    "qwen2": _LLAMA_KEYS,
    "qwen3": {
        **_LLAMA_KEYS,
        "layers.{}.attention.q_layernorm": "model.layers.{}.self_attn.q_norm",
        "layers.{}.attention.k_layernorm": "model.layers.{}.self_attn.k_norm",
    },
}
# The MoE families: their dense kin's names, plus the router and shared expert (the experts:
# hf_moe.py).
for _arch in MOE_ARCHS:
    HF_KEYS[_arch] = {**HF_KEYS[ATTENTION_ARCH[_arch]], **MOE_KEYS[_arch]}

# transformers >= 5 names GPTNeoX's output layer lm_head in memory; files on the hub say embed_out.
HF_ALIASES: dict[str, dict[str, str]] = {"gpt_neox": {"lm_head": "embed_out"}}

# Buffers older HF checkpoints (Pythia, early Llama) saved; they are recomputed, never loaded.
HF_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.attention\.bias|\.attention\.masked_bias)$")

HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our grouped fused QKV (weight or bias, rows first) -> separate q, k, v."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, num_heads // num_kv_heads + 2, head_dim, *rest)
    q = grouped[:, :-2].reshape(num_heads * head_dim, *rest)
    k = grouped[:, -2].reshape(num_kv_heads * head_dim, *rest)
    v = grouped[:, -1].reshape(num_kv_heads * head_dim, *rest)
    return q, k, v


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int
) -> torch.Tensor:
    """Separate q, k, v -> our fused layout: per kv group its query heads, its key, its value."""
    rest = q.shape[1:]
    group = num_heads // num_kv_heads
    q = q.reshape(num_kv_heads, group, -1, *rest)  # (nkv, grp, hs, ...)
    k = k.reshape(num_kv_heads, 1, -1, *rest)  # (nkv, 1, hs, ...)
    v = v.reshape(num_kv_heads, 1, -1, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)  # ((nh + 2*nkv)*hs, ...)


def check_exportable(cfg: ModelConfig, arch: str) -> None:
    """Raise ValueError listing every option the HF architecture `arch` cannot express, and the
    --architecture names that can write this model."""
    if arch not in ARCHS:
        raise ValueError(f"unknown HF architecture {arch!r}; use one of {ARCHS}")
    problems = export_problems(cfg, arch)
    if problems:
        fits = [ARCH_NAMES[a] for a in ARCHS if a != arch and not export_problems(cfg, a)]
        other = (
            f"or export with --architecture {' or '.join(fits)}"
            if fits
            else "no other --architecture can write it either"
        )
        raise ValueError(
            f"this model cannot be written as HF {arch}: " + "; ".join(problems) + ". "
            f"Change those keys, {other}."
        )


def export_problems(cfg: ModelConfig, arch: str) -> list[str]:
    """Every option of `cfg` the HF architecture `arch` cannot express."""
    problems, shape = [], cfg.shape
    name = HF_CLASSES[arch]
    problems += moe_problems(cfg, arch, name)
    if arch in ("qwen3", "qwen3_moe") and cfg.use_qk_layernorm:
        if cfg.qk_layernorm_scope != "head":
            problems.append("qk_layernorm_scope=projection (Qwen3 normalises each head)")
    arch = ATTENTION_ARCH.get(arch, arch)  # the rest is about attention, norms and the MLP
    if cfg.pos_emb != "rotary":
        problems.append(f"pos_emb={cfg.pos_emb!r} (HF {arch} is rotary only)")
    windows = {layer_window(cfg, kind) for kind in shape.layer_types}
    biases = cfg.use_bias_in_attn_linear, shape.attn_dense_bias
    if arch in ("gpt_neox", "llama") and windows != {None}:
        problems.append(f"sliding_window_width={cfg.sliding_window_width} ({name} has no window)")
    if arch == "mistral" and len(windows) > 1:
        problems.append("attention_config mixing local and global layers (Mistral windows all)")
    if cfg.use_qk_layernorm and arch != "qwen3":
        problems.append(f"use_qk_layernorm=true ({name} has no q/k norm)")
    if arch == "qwen3" and not cfg.use_qk_layernorm:
        problems.append("use_qk_layernorm=false (Qwen3 always normalises q and k)")
    if arch in ("gpt_neox", "llama", "qwen3") and biases[0] != biases[1]:
        problems.append(
            f"use_bias_in_attn_dense={biases[1]} with use_bias_in_attn_linear={biases[0]} "
            f"({name}'s attention_bias covers q, k, v and the output together)"
        )
    if arch == "mistral" and any(biases):
        problems.append("use_bias_in_attn_linear=true (Mistral's attention has no biases)")
    if arch == "qwen2" and biases != (True, False):
        problems.append(
            f"use_bias_in_attn_linear={biases[0]}, use_bias_in_attn_dense={biases[1]} (Qwen2 "
            "has q/k/v biases and no output bias: true and false)"
        )
    if arch in ("mistral", "qwen2", "qwen3") and cfg.use_bias_in_mlp:
        problems.append(f"use_bias_in_mlp=true ({name}'s MLP has no biases)")
    if arch == "gpt_neox":
        if cfg.norm != "layernorm" or not cfg.use_bias_in_norms:
            problems.append(f"norm={cfg.norm!r} (GPTNeoX needs layernorm with bias)")
        if shape.gated_mlp:
            problems.append(f"activation={cfg.activation!r} (GPTNeoX has no gated MLP)")
        if shape.kv_heads != cfg.num_attention_heads:
            problems.append(f"num_kv_heads={cfg.num_kv_heads} (GPTNeoX has no GQA)")
        if not cfg.use_bias_in_mlp:
            problems.append("use_bias_in_mlp=false (GPTNeoX's MLP always has biases)")
        if shape.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            problems.append(f"head_dim={cfg.head_dim} (GPTNeoX's is hidden_size / heads)")
    else:
        if cfg.norm != "rmsnorm":
            problems.append(f"norm={cfg.norm!r} (Llama needs rmsnorm)")
        if not shape.gated_mlp:
            problems.append(f"activation={cfg.activation!r} (Llama needs swiglu or geglu)")
        if cfg.gpt_j_residual:
            problems.append("gpt_j_residual=true (Llama is sequential)")
        if cfg.rotary_pct != 1.0:
            problems.append(f"rotary_pct={cfg.rotary_pct} (Llama rotates whole heads)")
    return problems


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' `rope_parameters` for this model: type, theta and the scaling's values
    (every default written out, so any transformers version computes the same frequencies)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rotary_emb_base)}
    rope = cfg.shape.rope
    if rope is None:
        return params
    params.update(rope_type=rope.rope_type, factor=rope.factor)
    if rope.rope_type == "llama3":
        params.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_positions,
        )
    if rope.rope_type == "yarn":
        params.update(
            original_max_position_embeddings=rope.original_max_positions,
            beta_fast=rope.beta_fast,
            beta_slow=rope.beta_slow,
            attention_factor=rope.attention_factor,
            truncate=rope.truncate,
        )
    return params


def _sliding_window(cfg: ModelConfig) -> dict[str, Any]:
    """Mistral's / Qwen's window keys: HF counts the query itself, so N + 1 keys for our N."""
    windows = [layer_window(cfg, kind) for kind in cfg.shape.layer_types]
    width = next((w for w in windows if w is not None), None)
    return {
        "windows": windows,
        "sliding_window": None if width is None else width + 1,
    }


def hf_config_for(cfg: ModelConfig, vocab_size: int, arch: str) -> dict[str, Any]:
    """The HF config.json content (a dict for transformers' config class) for this model."""
    check_exportable(cfg, arch)
    if arch in MOE_ARCHS:
        # The dense kin's config (attention, norms, rotary), then the expert fields.
        dense = cfg.model_copy(update={"moe_num_experts": 1, "qk_layernorm_scope": "head"})
        out = hf_config_for(dense, vocab_size, ATTENTION_ARCH[arch])
        if arch != "mixtral":  # no per-layer window keys: every layer full
            out = {k: v for k, v in out.items() if k not in ("max_window_layers", "layer_types")}
        if arch == "olmoe":  # and no window keys at all
            out = {k: v for k, v in out.items() if "sliding_window" not in k}
        out.update(architectures=[HF_CLASSES[arch]], model_type=arch)
        return {**out, **hf_moe_config(cfg, arch)}
    rope = rope_parameters(cfg)
    shape = cfg.shape
    common = {
        "architectures": [HF_CLASSES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": shape.ffn_size,
        "hidden_act": HF_ACTIVATIONS[activation_name(cfg)],
        "max_position_embeddings": shape.max_positions,
        "initializer_range": cfg.init_method_std,
        "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": not cfg.no_weight_tying,
    }
    if rope["rope_type"] != "default":
        common["rope_scaling"] = rope  # the name transformers < 5 reads
    if arch == "gpt_neox":
        return {
            **common,
            "attention_bias": cfg.use_bias_in_attn_linear,
            "hidden_dropout": cfg.hidden_dropout,
            "layer_norm_eps": cfg.layernorm_epsilon,
            "use_parallel_residual": cfg.gpt_j_residual,
            # transformers < 5 reads rotary_pct / rotary_emb_base; 5 reads rope_parameters.
            "rotary_pct": cfg.rotary_pct,
            "rotary_emb_base": cfg.rotary_emb_base,
            "rope_parameters": {**rope, "partial_rotary_factor": cfg.rotary_pct},
        }
    out = {
        **common,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": cfg.rms_norm_epsilon,
        "rope_theta": float(cfg.rotary_emb_base),
        "rope_parameters": rope,
    }
    if arch in ("llama", "qwen3"):
        out["attention_bias"] = cfg.use_bias_in_attn_linear
    if arch == "llama":
        out["mlp_bias"] = cfg.use_bias_in_mlp
    window = _sliding_window(cfg)
    if arch == "mistral":
        out["sliding_window"] = window["sliding_window"]
    if arch in ("qwen2", "qwen3"):
        local = [w is not None for w in window["windows"]]
        out.update(
            use_sliding_window=any(local),
            sliding_window=window["sliding_window"],
            # Qwen's own rule is "layers from max_window_layers on"; layer_types says it for any
            # pattern, and transformers reads it first.
            max_window_layers=local.index(True) if any(local) else cfg.num_layers,
            layer_types=["sliding_attention" if w else "full_attention" for w in local],
        )
    return out


def _template_regex(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(r"\{\}", r"(\d+)") + "$")


def _lookup(module: str, templates: list[str]) -> tuple[str, str | None]:
    """(matching template, layer index or None) for a module path."""
    for template in templates:
        m = _template_regex(template).match(module)
        if m:
            return template, (m.group(1) if m.groups() else None)
    raise KeyError(module)


def to_hf_state_dict(
    model_sd: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size_unpadded: int, arch: str
) -> dict[str, torch.Tensor]:
    """Our state dict -> HF `arch` names and shapes, padded vocabulary rows dropped."""
    check_exportable(cfg, arch)
    table, shape = HF_KEYS[arch], cfg.shape
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model_sd.items():
        experts = experts_to_hf(name, tensor, arch) if arch in MOE_ARCHS else None
        if experts is not None:
            out.update(experts)
            continue
        module, suffix = name.rsplit(".", 1)
        try:
            template, layer = _lookup(module, list(table))
        except KeyError:
            raise KeyError(f"{name!r} has no HF {arch} counterpart in HF_KEYS") from None
        if module in VOCAB_MODULES:
            # clone: a slice would keep the padded rows' storage alive inside the file.
            tensor = resize_vocab(tensor, vocab_size_unpadded).clone()
        hf = table[template]
        if isinstance(hf, tuple):
            parts = split_qkv(tensor, cfg.num_attention_heads, shape.kv_heads, shape.head_dim)
            for hf_module, part in zip(hf, parts):
                out[f"{hf_module.format(layer)}.{suffix}"] = part.contiguous()
        else:
            out[f"{hf.format(layer)}.{suffix}"] = tensor
    if cfg.gpt_j_tied:
        # One shared norm is exactly two HF norms holding the same numbers.
        ln1, ln2 = table["layers.{}.input_layernorm"], table["layers.{}.post_attention_layernorm"]
        for i in range(cfg.num_layers):
            for suffix in ("weight", "bias"):
                src = f"{ln1.format(i)}.{suffix}"
                if src in out:
                    out[f"{ln2.format(i)}.{suffix}"] = out[src].clone()
    return out


def from_hf_state_dict(
    hf_sd: dict[str, torch.Tensor],
    cfg: ModelConfig,
    padded_vocab_size: int,
    arch: str,
    fill_untied_head: bool = True,
) -> dict[str, torch.Tensor]:
    """HF `arch` state dict (hub file names or transformers' in-memory ones) -> ours.

    Any subset holding whole layers converts alone (q, k and v of a layer together).
    fill_untied_head: an untied model given an embedding but no output layer gets a copy of the
    embedding (a tied HF checkpoint); a caller converting part of a checkpoint whose output layer
    may come in another part passes False.
    """
    check_exportable(cfg, arch)
    table = HF_KEYS[arch]
    # HF module template -> (our template, index in a fused (q, k, v) or None).
    reverse: dict[str, tuple[str, int | None]] = {}
    for ours, hf in table.items():
        if isinstance(hf, tuple):
            reverse.update({h: (ours, i) for i, h in enumerate(hf)})
        else:
            reverse[hf] = (ours, None)
    aliases = HF_ALIASES.get(arch, {})
    out: dict[str, torch.Tensor] = {}
    pending_qkv: dict[str, list[torch.Tensor | None]] = {}
    experts = ExpertStacker(arch, cfg.moe_num_experts) if arch in MOE_ARCHS else None
    for name, tensor in hf_sd.items():
        if HF_IGNORED.search(name):
            continue
        if experts is not None:
            name = hub_name(name, arch)
            if experts.add(name, tensor):
                continue
        module, suffix = name.rsplit(".", 1)
        module = aliases.get(module, module)
        try:
            template, layer = _lookup(module, list(reverse))
        except KeyError:
            raise KeyError(
                f"HF key {name!r} has no neox counterpart in HF_KEYS[{arch!r}]"
            ) from None
        ours, part = reverse[template]
        ours_name = f"{ours.format(layer)}.{suffix}"
        if ours == "embed_out" and not cfg.no_weight_tying:
            continue  # tied: our logits reuse embed_in
        if ours.endswith("post_attention_layernorm") and cfg.gpt_j_tied:
            continue  # one shared norm: input_layernorm holds it
        if part is not None:
            pending_qkv.setdefault(ours_name, [None, None, None])[part] = tensor
            continue
        if ours in VOCAB_MODULES:
            tensor = resize_vocab(tensor, padded_vocab_size)
        out[ours_name] = tensor
    for ours_name, (q, k, v) in pending_qkv.items():
        if q is None or k is None or v is None:
            raise KeyError(f"HF checkpoint lacks one of q/k/v for {ours_name!r}")
        out[ours_name] = fuse_qkv(q, k, v, cfg.num_attention_heads, cfg.shape.kv_heads)
    if experts is not None:
        out.update(experts.finish())
    fill = fill_untied_head and cfg.no_weight_tying
    if fill and "embed_out.weight" not in out and "embed_in.weight" in out:
        # A tied HF checkpoint loaded into an untied model: both start from the embedding.
        out["embed_out.weight"] = out["embed_in.weight"].clone()
    return out


# PEFT's key prefix for a LoRA adapter on a causal LM (PeftModelForCausalLM.base_model.model).
PEFT_PREFIX = "base_model.model."


def to_peft_state_dict(
    adapters: dict[str, torch.Tensor], cfg: ModelConfig, arch: str
) -> dict[str, torch.Tensor]:
    """Our full lora_A/lora_B weights -> PEFT's adapter_model.safetensors keys for HF `arch`.

    A fused query_key_value exported as Llama's q/k/v is three adapters sharing A, each with
    its rows of B: B A split by rows is exactly (B_q A, B_k A, B_v A)."""
    table, shape = HF_KEYS[arch], cfg.shape
    out: dict[str, torch.Tensor] = {}
    for name, tensor in adapters.items():
        module, which, suffix = name.rsplit(".", 2)  # (linear, lora_A|lora_B, weight)
        template, layer = _lookup(module, list(table))
        hf = table[template]
        if isinstance(hf, tuple):
            if which == "lora_B":
                parts = split_qkv(tensor, cfg.num_attention_heads, shape.kv_heads, shape.head_dim)
            else:
                parts = (tensor, tensor, tensor)
            for hf_module, part in zip(hf, parts):
                out[f"{PEFT_PREFIX}{hf_module.format(layer)}.{which}.{suffix}"] = part.clone()
        else:
            out[f"{PEFT_PREFIX}{hf.format(layer)}.{which}.{suffix}"] = tensor
    return out


def peft_target_modules(peft_sd: dict[str, torch.Tensor]) -> list[str]:
    """The HF module names (last component) a PEFT state dict adapts, for adapter_config.json."""
    return sorted({k.rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in peft_sd})
