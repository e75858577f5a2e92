"""What a config costs, computed without torch: parameters and training FLOPs per token.

Imported by deepy.py's dry run and by the training loop's TFLOPS/MFU, so both use one formula.
"""

from __future__ import annotations

from neox.config.model import ModelConfig


def norm_parameters(cfg: ModelConfig, dim: int) -> int:
    """Parameters of one norm over `dim` features."""
    if cfg.norm == "layernorm":
        return dim * (2 if cfg.use_bias_in_norms else 1)
    if cfg.norm == "rmsnorm":
        return dim
    return 1  # scalenorm: one gain


def layer_parameters(cfg: ModelConfig) -> int:
    """Parameters of one transformer block."""
    h, hs = cfg.hidden_size, cfg.head_dim
    nh, nkv, ffn = cfg.num_attention_heads, cfg.kv_heads, cfg.ffn_size
    attn_bias, mlp_bias = int(cfg.use_bias_in_attn_linear), int(cfg.use_bias_in_mlp)

    qkv = (nh + 2 * nkv) * hs * (h + attn_bias)
    dense = nh * hs * h + h * attn_bias
    qk_norms = 2 * norm_parameters(cfg, hs) if cfg.use_qk_layernorm else 0
    branches = 2 if cfg.gated_mlp else 1
    mlp = branches * ffn * (h + mlp_bias) + ffn * h + h * mlp_bias
    norms = (1 if cfg.gpt_j_tied else 2) * norm_parameters(cfg, h)
    return qkv + dense + qk_norms + mlp + norms


def count_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Number of parameters of GPTNeoX(cfg, vocab_size), tied weights counted once."""
    h = cfg.hidden_size
    total = vocab_size * h + cfg.num_layers * layer_parameters(cfg) + norm_parameters(cfg, h)
    if cfg.pos_emb == "learned":
        total += (cfg.max_positions + cfg.opt_pos_emb_offset) * h
    if cfg.no_weight_tying:
        total += vocab_size * h
    return total


def flops_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """N of the FLOPs formula: every matrix a token passes through, i.e. the non-embedding
    parameters plus the output layer (counted whether or not it is tied to the embedding)."""
    h = cfg.hidden_size
    return cfg.num_layers * layer_parameters(cfg) + norm_parameters(cfg, h) + vocab_size * h


def train_flops_per_token(cfg: ModelConfig, vocab_size: int) -> int:
    """Training FLOPs per token, forward + backward: 6N + 12 * L * h * s (attention scores and
    their weighted sum over the full sequence, as Megatron and PaLM count them; no recompute)."""
    attention = 12 * cfg.num_layers * cfg.hidden_size * cfg.seq_length
    return 6 * flops_parameters(cfg, vocab_size) + attention
