"""Analytic parameter count of a GPTNeoX, without building one."""

from __future__ import annotations

from neox.config.model import ModelConfig


def norm_parameters(cfg: ModelConfig, dim: int) -> int:
    """Parameters of one norm over `dim` features."""
    if cfg.norm == "layernorm":
        return dim * (2 if cfg.use_bias_in_norms else 1)
    if cfg.norm == "rmsnorm":
        return dim
    return 1  # scalenorm: one gain


def count_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Number of parameters of GPTNeoX(cfg, vocab_size), tied weights counted once."""
    h, hs = cfg.hidden_size, cfg.head_dim
    nh, nkv, ffn = cfg.num_attention_heads, cfg.kv_heads, cfg.ffn_size
    attn_bias, mlp_bias = int(cfg.use_bias_in_attn_linear), int(cfg.use_bias_in_mlp)

    qkv = (nh + 2 * nkv) * hs * (h + attn_bias)
    dense = nh * hs * h + h * attn_bias
    qk_norms = 2 * norm_parameters(cfg, hs) if cfg.use_qk_layernorm else 0
    branches = 2 if cfg.gated_mlp else 1
    mlp = branches * ffn * (h + mlp_bias) + ffn * h + h * mlp_bias
    norms = (1 if cfg.gpt_j_tied else 2) * norm_parameters(cfg, h)
    per_layer = qkv + dense + qk_norms + mlp + norms

    total = vocab_size * h + cfg.num_layers * per_layer + norm_parameters(cfg, h)
    if cfg.pos_emb == "learned":
        total += (cfg.max_positions + cfg.opt_pos_emb_offset) * h
    if cfg.no_weight_tying:
        total += vocab_size * h
    return total
