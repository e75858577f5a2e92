"""neox <-> Hugging Face state-dict conversion for GPTNeoXForCausalLM and LlamaForCausalLM.

The name table below is used in both directions; the only reshapes are the fused QKV split for
Llama's separate q/k/v projections and the padded vocabulary rows (dropped on export, zeros on
import). Llama weights are taken in HF's own format: HF's rotate-half rotary is ours, so no
q/k permutation is needed (that permutation only exists between Meta's and HF's files).
"""

from __future__ import annotations

import re
from typing import Any, Union

import torch

from neox.config.model import ModelConfig
from neox.model.mlp import activation_name

ARCHS = ("gpt_neox", "llama")

HFName = Union[str, tuple[str, str, str]]

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
    "llama": {
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
    },
}

# transformers >= 5 names GPTNeoX's output layer lm_head in memory; files on the hub say embed_out.
HF_ALIASES = {"gpt_neox": {"lm_head": "embed_out"}, "llama": {}}

# Buffers older HF GPTNeoX checkpoints (Pythia) saved; they are recomputed, never loaded.
HF_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.attention\.bias|\.attention\.masked_bias)$")

HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}

VOCAB_MODULES = ("embed_in", "embed_out")


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


def resize_vocab(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Keep the first `rows` rows, or append zero rows up to `rows` (padded vocabulary)."""
    if weight.shape[0] >= rows:
        return weight[:rows]
    pad = weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])
    return torch.cat((weight, pad))


def check_exportable(cfg: ModelConfig, arch: str) -> None:
    """Raise ValueError listing every option the HF architecture `arch` cannot express."""
    if arch not in ARCHS:
        raise ValueError(f"unknown HF architecture {arch!r}; use one of {ARCHS}")
    problems, shape = [], cfg.shape
    if cfg.pos_emb != "rotary":
        problems.append(f"pos_emb={cfg.pos_emb!r} (HF {arch} is rotary only)")
    if cfg.use_qk_layernorm:
        problems.append("use_qk_layernorm=true")
    if cfg.sliding_window_width is not None:
        problems.append(f"sliding_window_width={cfg.sliding_window_width}")
    if arch == "gpt_neox":
        if cfg.norm != "layernorm" or not cfg.use_bias_in_norms:
            problems.append(f"norm={cfg.norm!r} (GPTNeoX needs layernorm with bias)")
        if shape.gated_mlp:
            problems.append(f"activation={cfg.activation!r} (GPTNeoX has no gated MLP)")
        if shape.kv_heads != cfg.num_attention_heads:
            problems.append(f"num_kv_heads={cfg.num_kv_heads} (GPTNeoX has no GQA)")
        if not cfg.use_bias_in_mlp:
            problems.append("use_bias_in_mlp=false (GPTNeoX's MLP always has biases)")
    else:
        if cfg.norm != "rmsnorm":
            problems.append(f"norm={cfg.norm!r} (Llama needs rmsnorm)")
        if not shape.gated_mlp:
            problems.append(f"activation={cfg.activation!r} (Llama needs swiglu or geglu)")
        if cfg.gpt_j_residual:
            problems.append("gpt_j_residual=true (Llama is sequential)")
        if cfg.rotary_pct != 1.0:
            problems.append(f"rotary_pct={cfg.rotary_pct} (Llama rotates whole heads)")
    if problems:
        raise ValueError(
            f"this model cannot be written as HF {arch}: " + "; ".join(problems) + ". "
            f"Change those keys or pick the other arch ({', '.join(ARCHS)})."
        )


def hf_config_for(cfg: ModelConfig, vocab_size: int, arch: str) -> dict[str, Any]:
    """The HF config.json content (a dict for transformers' config class) for this model."""
    check_exportable(cfg, arch)
    rope = {"rope_type": "default", "rope_theta": float(cfg.rotary_emb_base)}
    shape = cfg.shape
    common = {
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": shape.ffn_size,
        "hidden_act": HF_ACTIVATIONS[activation_name(cfg)],
        "max_position_embeddings": shape.max_positions,
        "initializer_range": cfg.init_method_std,
        "attention_dropout": cfg.attention_dropout,
        "attention_bias": cfg.use_bias_in_attn_linear,
        "tie_word_embeddings": not cfg.no_weight_tying,
    }
    if arch == "gpt_neox":
        return {
            "architectures": ["GPTNeoXForCausalLM"],
            "model_type": "gpt_neox",
            **common,
            "hidden_dropout": cfg.hidden_dropout,
            "layer_norm_eps": cfg.layernorm_epsilon,
            "use_parallel_residual": cfg.gpt_j_residual,
            # transformers < 5 reads rotary_pct / rotary_emb_base; 5 reads rope_parameters.
            "rotary_pct": cfg.rotary_pct,
            "rotary_emb_base": cfg.rotary_emb_base,
            "rope_parameters": {**rope, "partial_rotary_factor": cfg.rotary_pct},
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": cfg.rms_norm_epsilon,
        "mlp_bias": cfg.use_bias_in_mlp,
        "rope_theta": float(cfg.rotary_emb_base),
        "rope_parameters": rope,
    }


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
    hf_sd: dict[str, torch.Tensor], cfg: ModelConfig, padded_vocab_size: int, arch: str
) -> dict[str, torch.Tensor]:
    """HF `arch` state dict (hub file names or transformers' in-memory ones) -> ours."""
    check_exportable(cfg, arch)
    table = HF_KEYS[arch]
    # HF module template -> (our template, index in a fused (q, k, v) or None).
    reverse: dict[str, tuple[str, int | None]] = {}
    for ours, hf in table.items():
        if isinstance(hf, tuple):
            reverse.update({h: (ours, i) for i, h in enumerate(hf)})
        else:
            reverse[hf] = (ours, None)
    aliases = HF_ALIASES[arch]
    out: dict[str, torch.Tensor] = {}
    pending_qkv: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in hf_sd.items():
        if HF_IGNORED.search(name):
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
    if cfg.no_weight_tying and "embed_out.weight" not in out and "embed_in.weight" in out:
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
