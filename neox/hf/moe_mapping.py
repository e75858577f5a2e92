"""The mixture-of-experts half of the HF conversion (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE):
config keys both ways and the expert weights, stacked in neox ((E, F, C) tensors,
neox/model/moe.py) and one linear per expert in HF's files.

Files on the hub (and transformers' save_pretrained) hold one linear per expert:
  Mixtral    model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight   (gate, up, down)
  Qwen*-MoE  model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight   (OLMoE too)
transformers >= 5 fuses them in memory (mlp.experts.gate_up_proj (E, 2F, C), gate rows first,
and mlp.experts.down_proj (E, C, F)); both spellings are read, the hub's is written.

Qwen2-MoE adds a shared expert (our shared_experts MLP) scaled by a sigmoid gate; OLMoE's
attention normalises the whole query and key projections (qk_layernorm_scope: projection).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from neox.config.model import ModelConfig

MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")
# The dense family whose attention, norms and config keys each MoE family shares.
ATTENTION_ARCH = {
    "mixtral": "mistral",
    "qwen3_moe": "qwen3",
    "qwen2_moe": "qwen2",
    "olmoe": "qwen3",
}
_QWEN_LINEARS = {"gate": "gate_proj", "dense_h_to_4h": "up_proj", "dense_4h_to_h": "down_proj"}
# neox module -> HF module besides the experts: the router, Qwen2-MoE's shared expert.
MOE_KEYS = {
    "mixtral": {"layers.{}.mlp.router": "model.layers.{}.block_sparse_moe.gate"},
    "qwen3_moe": {"layers.{}.mlp.router": "model.layers.{}.mlp.gate"},
    "olmoe": {"layers.{}.mlp.router": "model.layers.{}.mlp.gate"},
    "qwen2_moe": {
        "layers.{}.mlp.router": "model.layers.{}.mlp.gate",
        "layers.{}.mlp.shared_expert_gate": "model.layers.{}.mlp.shared_expert_gate",
        **{
            f"layers.{{}}.mlp.shared_experts.{ours}": f"model.layers.{{}}.mlp.shared_expert.{hf}"
            for ours, hf in _QWEN_LINEARS.items()
        },
    },
}
_EXPERTS = {
    "mixtral": "model.layers.{}.block_sparse_moe.experts",
    "qwen3_moe": "model.layers.{}.mlp.experts",
    "qwen2_moe": "model.layers.{}.mlp.experts",
    "olmoe": "model.layers.{}.mlp.experts",
}
# neox's stacked expert tensor -> the per-expert linear's name in HF's files.
EXPERT_LINEARS = {
    "mixtral": {"gate": "w1", "dense_h_to_4h": "w3", "dense_4h_to_h": "w2"},
    "qwen3_moe": _QWEN_LINEARS,
    "qwen2_moe": _QWEN_LINEARS,
    "olmoe": _QWEN_LINEARS,
}
_HUB_EXPERT = {
    arch: re.compile(re.escape(t).replace(r"\{\}", r"(\d+)") + r"\.(\d+)\.(\w+)\.weight$")
    for arch, t in _EXPERTS.items()
}
_FUSED_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_OURS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate|dense_h_to_4h|dense_4h_to_h)$")
# Fields of the MoE families' config.json that neox_model_keys reads.
_ROUTING = {"num_experts", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"}
_QWEN = _ROUTING | {"norm_topk_prob", "moe_intermediate_size", "decoder_sparse_step"}
_QWEN |= {"mlp_only_layers"}
READ_FIELDS = {
    "mixtral": _ROUTING | {"router_jitter_noise"},
    "qwen3_moe": _QWEN,
    "qwen2_moe": _QWEN | {"shared_expert_intermediate_size", "qkv_bias"},
    "olmoe": _ROUTING | {"norm_topk_prob", "clip_qkv", "attention_bias"},
}


def hub_name(name: str, arch: str) -> str:
    """transformers' in-memory router name as the hub's files spell it (Mixtral's mlp.gate is
    block_sparse_moe.gate on disk)."""
    if arch == "mixtral":
        return re.sub(r"\.mlp\.gate\.weight$", ".block_sparse_moe.gate.weight", name)
    return name


def experts_to_hf(name: str, tensor: torch.Tensor, arch: str) -> Optional[dict[str, torch.Tensor]]:
    """A stacked neox expert tensor -> its per-expert HF linears; None for any other name."""
    m = _OURS.match(name)
    if m is None:
        return None
    layer, ours = m.groups()
    linear = EXPERT_LINEARS[arch][ours]
    prefix = _EXPERTS[arch].format(layer)
    return {f"{prefix}.{e}.{linear}.weight": w.clone() for e, w in enumerate(tensor.unbind(0))}


class ExpertStacker:
    """Collects HF expert tensors (either spelling) and stacks each layer's into neox's."""

    def __init__(self, arch: str, num_experts: int) -> None:
        self.arch, self.num_experts = arch, num_experts
        self.ours = {hf: ours for ours, hf in EXPERT_LINEARS[arch].items()}
        self.parts: dict[str, dict[int, torch.Tensor]] = {}
        self.stacked: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Take `name` if it is an expert weight; False for any other tensor."""
        m = _HUB_EXPERT[self.arch].match(name)
        if m and m.group(3) in self.ours:
            layer, expert, linear = m.groups()
            key = f"layers.{layer}.mlp.experts.{self.ours[linear]}"
            self.parts.setdefault(key, {})[int(expert)] = tensor
            return True
        m = _FUSED_EXPERT.match(name)
        if m is None:
            return False
        layer, fused = m.groups()
        prefix = f"layers.{layer}.mlp.experts"
        if fused == "down_proj":
            self.stacked[f"{prefix}.dense_4h_to_h"] = tensor
        else:
            gate, up = tensor.chunk(2, dim=1)  # (E, 2F, C): gate rows, then up rows
            self.stacked.update({f"{prefix}.gate": gate, f"{prefix}.dense_h_to_4h": up})
        return True

    def finish(self) -> dict[str, torch.Tensor]:
        """The stacked (E, ...) tensors; KeyError naming a layer that lacks an expert."""
        out = dict(self.stacked)
        for key, experts in self.parts.items():
            missing = sorted(set(range(self.num_experts)) - set(experts))
            extra = sorted(set(experts) - set(range(self.num_experts)))
            if missing or extra:
                raise KeyError(
                    f"HF checkpoint's experts for {key!r}: missing {missing}, beyond "
                    f"num_experts={self.num_experts}: {extra}"
                )
            out[key] = torch.stack([experts[e] for e in range(self.num_experts)])
        return out


def moe_problems(cfg: ModelConfig, arch: str, name: str) -> list[str]:
    """What of cfg's MLPs the HF family `arch` (dense or MoE) cannot express."""
    moe = cfg.moe_num_experts > 1
    if arch not in MOE_ARCHS:
        return [f"moe_num_experts={cfg.moe_num_experts} ({name} has no experts)"] if moe else []
    if not moe:
        return [f"moe_num_experts={cfg.moe_num_experts} ({name} needs experts: 2 or more)"]
    problems = []
    if cfg.moe_expert_interval != 1:
        problems.append(f"moe_expert_interval={cfg.moe_expert_interval} ({name}: every layer)")
    shared, gate = cfg.moe_num_shared_experts, cfg.moe_shared_expert_gate
    if arch == "qwen2_moe" and not (shared and gate):
        problems.append(
            f"moe_num_shared_experts={shared}, moe_shared_expert_gate={gate} (Qwen2-MoE has a "
            "gated shared expert: 1 or more and true)"
        )
    if arch != "qwen2_moe" and shared:
        problems.append(f"moe_num_shared_experts={shared} ({name} has none)")
    # The Router's rule: gpt-neox's sinkhorn router scores by sigmoid unless told.
    sinkhorn = cfg.moe_router_type == "sinkhorn" and cfg.moe_type != "deepspeed"
    score = cfg.moe_score_func or ("sigmoid" if sinkhorn else "softmax")
    if score != "softmax":
        problems.append(f"router scores by {score} ({name} by softmax): set moe_score_func")
    if cfg.moe_token_dropping:
        problems.append(f"moe_token_dropping=true ({name} is dropless)")
    if arch == "mixtral" and not cfg.moe_norm_topk_prob:
        problems.append("moe_norm_topk_prob=false (Mixtral renormalises the top-k weights)")
    if cfg.use_bias_in_mlp:
        problems.append(f"use_bias_in_mlp=true ({name}'s experts have no biases)")
    whole = cfg.use_qk_layernorm and cfg.qk_layernorm_scope == "projection"
    if arch == "olmoe" and not whole:
        problems.append("qk norms per head (OLMoE normalises the whole projections)")
    if arch != "mixtral" and cfg.sliding_window_width is not None:
        problems.append(f"sliding_window_width set (neox writes {name} without windows)")
    return problems


def hf_moe_config(cfg: ModelConfig, arch: str) -> dict[str, Any]:
    """config.json's expert fields for this model."""
    width = cfg.moe_ffn_hidden_size or cfg.shape.ffn_size
    common = {
        "num_experts_per_tok": cfg.moe_top_k,
        "router_aux_loss_coef": cfg.moe_loss_coeff,
        "output_router_logits": False,
    }
    if arch == "olmoe":
        return {
            **common,
            "num_experts": cfg.moe_num_experts,
            "intermediate_size": width,  # OLMoE's experts are its MLP width
            "norm_topk_prob": cfg.moe_norm_topk_prob,
            "clip_qkv": None,
        }
    if arch == "mixtral":
        return {
            **common,
            "num_local_experts": cfg.moe_num_experts,
            "intermediate_size": width,  # Mixtral's experts are its MLP width
            "router_jitter_noise": cfg.moe_jitter_eps or 0.0,
        }
    qwen = {
        **common,
        "num_experts": cfg.moe_num_experts,
        "moe_intermediate_size": width,
        "norm_topk_prob": cfg.moe_norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch == "qwen2_moe":
        qwen.update(
            shared_expert_intermediate_size=width * cfg.moe_num_shared_experts, qkv_bias=True
        )
    return qwen


def neox_moe_keys(hf: dict[str, Any], arch: str, problems: list[str]) -> dict[str, Any]:
    """Our moe_* keys from an MoE family's config.json; problems are appended."""
    # Qwen3-MoE's files say num_experts; transformers >= 5 writes num_local_experts.
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    top_k = hf.get("num_experts_per_tok")
    if type(experts) is not int or experts < 2 or type(top_k) is not int or not 0 < top_k:
        problems.append(f"experts={experts!r}, num_experts_per_tok={top_k!r} (2 or more experts)")
        return {}
    keys: dict[str, Any] = {
        "moe_num_experts": experts,
        "moe_top_k": top_k,
        "moe_router_type": "topk",
        "moe_score_func": "softmax",
        "moe_loss_coeff": hf.get("router_aux_loss_coef", 0.001),
    }
    if arch == "mixtral":
        if hf.get("router_jitter_noise"):
            keys["moe_jitter_eps"] = hf["router_jitter_noise"]
        return {**keys, "moe_norm_topk_prob": True, "moe_ffn_hidden_size": hf["intermediate_size"]}
    if arch == "olmoe":
        if hf.get("clip_qkv") is not None:
            problems.append(f"clip_qkv={hf['clip_qkv']} (neox does not clip q, k and v)")
        keys.update(
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_ffn_hidden_size=hf["intermediate_size"],
            qk_layernorm_scope="projection",
        )
        return keys
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        problems.append(
            f"decoder_sparse_step={step}, mlp_only_layers={dense} (neox reads Qwen3-MoE with "
            "experts in every layer: 1 and [])"
        )
    # Qwen3-MoE windows every layer when sliding_window is set; Qwen2-MoE when
    # use_sliding_window says so (by layer_types). neox reads both without windows.
    windowed = "sliding_attention" in (hf.get("layer_types") or [])
    windowed |= bool(hf.get("use_sliding_window"))
    if arch == "qwen3_moe":
        windowed |= hf.get("sliding_window") is not None
    if windowed:
        problems.append(
            f"sliding windows (use_sliding_window={hf.get('use_sliding_window')}, "
            f"sliding_window={hf.get('sliding_window')}): neox reads {arch} without windows"
        )
    ffn = hf.get("moe_intermediate_size", hf["intermediate_size"])
    keys.update(moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)), moe_ffn_hidden_size=ffn)
    if arch == "qwen2_moe":
        shared = hf.get("shared_expert_intermediate_size", 0)
        if not shared or shared % ffn:
            problems.append(
                f"shared_expert_intermediate_size={shared} (neox's shared experts are a multiple "
                f"of moe_intermediate_size={ffn} wide)"
            )
        if not hf.get("qkv_bias", True):
            problems.append("qkv_bias=false (neox reads Qwen2-MoE with q/k/v biases)")
        keys.update(moe_num_shared_experts=shared // ffn, moe_shared_expert_gate=True)
    return keys
