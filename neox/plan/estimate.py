"""What a config costs, computed without torch: parameters and training FLOPs per token.

Imported by deepy.py's dry run and by the training loop's TFLOPS/MFU, so both use one formula.
Parameters are counted tensor by tensor (`block_tensor_sizes`), so the same list gives the
model's total, a tensor-parallel rank's share, a pipeline stage's share and ZeRO-3's
persistent (unpartitioned) small tensors.
"""

from __future__ import annotations

import math

from neox.config.model import ModelConfig
from neox.plan.attention_path import layer_window


def norm_parameters(cfg: ModelConfig, dim: int) -> int:
    """Parameters of one norm over `dim` features."""
    if cfg.norm == "layernorm":
        return dim * (2 if cfg.use_bias_in_norms else 1)
    if cfg.norm == "rmsnorm":
        return dim
    return 1  # scalenorm: one gain


def _norm_tensors(cfg: ModelConfig, dim: int) -> list[int]:
    if cfg.norm == "layernorm" and cfg.use_bias_in_norms:
        return [dim, dim]
    return [norm_parameters(cfg, dim)]


def block_tensor_sizes(cfg: ModelConfig, tp: int = 1, moe: bool = False) -> list[int]:
    """Elements of each parameter tensor of one transformer block on one tensor-parallel rank
    (an MoE block with `moe`).

    Column-parallel layers (qkv, MLP up/gate) split weight and bias; row-parallel ones (attention
    dense, MLP down) split the weight and keep the bias whole; norms, the router and the
    experts are replicated.
    """
    shape = cfg.shape
    h, hs = cfg.hidden_size, shape.head_dim
    qkv_out = (cfg.num_attention_heads + 2 * shape.kv_heads) * hs // tp
    attn_in = cfg.num_attention_heads * hs // tp
    ffn = shape.ffn_size // tp
    branches = 2 if shape.gated_mlp else 1
    mlp = moe_matrix_sizes(cfg) if moe else [ffn * h] * branches + [h * ffn]
    return [qkv_out * h, attn_in * h] + mlp + block_vector_sizes(cfg, tp, moe)


def moe_matrix_sizes(cfg: ModelConfig, experts: int | None = None) -> list[int]:
    """The matrices of one MoE MLP (neox/model/moe.py): router, the stacked experts (all of
    them, or `experts` of them), the shared experts' MLP."""
    h, e = cfg.hidden_size, cfg.moe_num_experts if experts is None else experts
    ffn = cfg.moe_ffn_hidden_size or cfg.shape.ffn_size
    per_expert = [e * ffn * h] * (2 if cfg.shape.gated_mlp else 1) + [e * h * ffn]
    shared = ffn * cfg.moe_num_shared_experts
    shared_mlp = [shared * h] * (2 if cfg.shape.gated_mlp else 1) + [h * shared] if shared else []
    gate = [h] if shared and cfg.moe_shared_expert_gate else []
    return [cfg.moe_num_experts * h] + per_expert + shared_mlp + gate


def moe_layers(cfg: ModelConfig) -> list[bool]:
    """Whether each layer is an MoE layer."""
    return [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]


def block_vector_sizes(cfg: ModelConfig, tp: int = 1, moe: bool = False) -> list[int]:
    """Elements of each bias and norm gain (the 1-D tensors) of one block on one tensor-parallel
    rank; neox's optimizer puts them in the group without weight decay."""
    shape = cfg.shape
    h, hs = cfg.hidden_size, shape.head_dim
    qkv_out = (cfg.num_attention_heads + 2 * shape.kv_heads) * hs // tp
    ffn = shape.ffn_size // tp
    sizes = []
    if cfg.use_bias_in_attn_linear:
        sizes.append(qkv_out)
    if shape.attn_dense_bias:
        sizes.append(h)
    if cfg.use_qk_layernorm and cfg.qk_layernorm_scope == "projection":  # tp 1 only
        sizes += _norm_tensors(cfg, cfg.num_attention_heads * hs)
        sizes += _norm_tensors(cfg, shape.kv_heads * hs)
    elif cfg.use_qk_layernorm:
        sizes += 2 * _norm_tensors(cfg, hs)
    shared = (cfg.moe_ffn_hidden_size or shape.ffn_size) * cfg.moe_num_shared_experts
    if cfg.use_bias_in_mlp and not moe:
        sizes += [ffn] * (2 if shape.gated_mlp else 1) + [h]
    elif cfg.use_bias_in_mlp and shared:  # experts have no biases; shared experts may
        sizes += [shared] * (2 if shape.gated_mlp else 1) + [h]
    for _ in range(1 if cfg.gpt_j_tied else 2):
        sizes += _norm_tensors(cfg, h)
    return sizes


def lora_block_parameters(cfg: ModelConfig, rank: int, targets: list[str], tp: int = 1) -> int:
    """LoRA adapter elements of one block on one tensor-parallel rank: r (in + out) per target
    linear, the split side of each divided by tp (neox/model/transforms/lora.py: a column-parallel
    base splits B, a row-parallel one A)."""
    shape = cfg.shape
    h, hs = cfg.hidden_size, shape.head_dim
    qkv_out = (cfg.num_attention_heads + 2 * shape.kv_heads) * hs
    attn_in, ffn = cfg.num_attention_heads * hs, shape.ffn_size
    # target -> (in, out, column-parallel)
    linears = {
        "query_key_value": (h, qkv_out, True),
        "dense": (attn_in, h, False),
        "dense_h_to_4h": (h, ffn, True),
        "gate": (h, ffn, True),
        "dense_4h_to_h": (ffn, h, False),
    }
    total = 0
    for name in targets:
        n_in, n_out, column = linears[name]
        total += rank * (n_in + n_out // tp if column else n_in // tp + n_out)
    return total


def vector_parameters(cfg: ModelConfig) -> int:
    """Elements of the whole model's biases and norm gains (tp = pp = 1)."""
    blocks = sum(sum(block_vector_sizes(cfg, moe=moe)) for moe in moe_layers(cfg))
    return blocks + sum(_norm_tensors(cfg, cfg.hidden_size))


def layer_parameters(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of the largest transformer block (on one tensor-parallel rank)."""
    return max(sum(block_tensor_sizes(cfg, tp, moe)) for moe in set(moe_layers(cfg)))


def active_layer_parameters(cfg: ModelConfig, moe: bool) -> int:
    """Parameters of one block that a token passes through: with `moe`, the router, its top-k
    experts and the shared experts."""
    if not moe:
        return sum(block_tensor_sizes(cfg))
    everything = sum(block_tensor_sizes(cfg, moe=True))
    return everything - sum(moe_matrix_sizes(cfg)) + sum(moe_matrix_sizes(cfg, cfg.moe_top_k))


def blocks_per_stage(num_layers: int, pp: int) -> list[int]:
    """Blocks on each pipeline stage as DeepSpeed's type:Block partition balances them: the
    first stages take one extra each when they do not divide evenly."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if stage < extra else 0) for stage in range(pp)]


def stage_tensor_sizes(
    cfg: ModelConfig, vocab_size: int, tp: int = 1, pp: int = 1, stage: int = 0
) -> list[int]:
    """Elements of each parameter tensor held by one rank of pipeline stage `stage`.

    The first stage holds the embeddings, the last the final norm and the head; with pp > 1 a
    tied head is a second copy of the embedding on the last stage (DeepSpeed's TiedLayerSpec).
    """
    h, first, last = cfg.hidden_size, stage == 0, stage == pp - 1
    sizes: list[int] = []
    if first:
        sizes.append(vocab_size // tp * h)
        if cfg.pos_emb == "learned":
            sizes.append(cfg.shape.position_rows * h)
    counts = blocks_per_stage(cfg.num_layers, pp)
    first_layer = sum(counts[:stage])
    for moe in moe_layers(cfg)[first_layer : first_layer + counts[stage]]:
        sizes += block_tensor_sizes(cfg, tp, moe)
    if last:
        sizes += _norm_tensors(cfg, h)
        if cfg.no_weight_tying or pp > 1:
            sizes.append(vocab_size // tp * h)
    return sizes


def count_parameters(cfg: ModelConfig, vocab_size: int, tp: int = 1, pp: int = 1) -> int:
    """Number of parameters of GPTNeoX(cfg, vocab_size), tied weights counted once; with tp or
    pp, the most any one rank holds (the tied pipeline copy counts on the last stage)."""
    if tp == 1 and pp == 1:
        return sum(stage_tensor_sizes(cfg, vocab_size))
    return max(sum(stage_tensor_sizes(cfg, vocab_size, tp, pp, s)) for s in range(pp))


def embedding_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Parameters of the input (and learned position) embeddings and an untied output layer."""
    h = cfg.hidden_size
    total = vocab_size * h * (2 if cfg.no_weight_tying else 1)
    if cfg.pos_emb == "learned":
        total += cfg.shape.position_rows * h
    return total


def flops_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """N of the FLOPs formula: every matrix a token passes through, i.e. the non-embedding
    parameters plus the output layer (counted whether or not it is tied to the embedding); in
    MoE layers the router, the top-k experts and the shared experts (FLOPs of active
    parameters)."""
    h = cfg.hidden_size
    blocks = sum(active_layer_parameters(cfg, moe) for moe in moe_layers(cfg))
    return blocks + norm_parameters(cfg, h) + vocab_size * h


def active_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Parameters a token's forward uses (count_parameters less the experts it is not routed
    to); the total for a dense model."""
    idle = sum(moe_matrix_sizes(cfg)) - sum(moe_matrix_sizes(cfg, cfg.moe_top_k))
    return count_parameters(cfg, vocab_size) - idle * sum(moe_layers(cfg))


def train_flops_per_token(cfg: ModelConfig, vocab_size: int) -> int:
    """Training FLOPs per token, forward + backward: 6N + 12 * L * h * s (attention scores and
    their weighted sum over the full sequence, as Megatron and PaLM count them; no recompute),
    h being the query width heads x head_dim (hidden_size unless head_dim says otherwise) and s
    the keys a query can see: the sequence, or a sliding window's N + 1 keys if fewer."""
    width = cfg.num_attention_heads * cfg.shape.head_dim
    keys = 0
    for kind in cfg.shape.layer_types:
        window = layer_window(cfg, kind)
        keys += cfg.seq_length if window is None else min(cfg.seq_length, window + 1)
    attention = 12 * width * keys
    return 6 * flops_parameters(cfg, vocab_size) + attention


def expert_parameters(cfg: ModelConfig, ep: int = 1) -> int:
    """Routed-expert parameters of the whole model, or those one rank of an expert-parallel
    group of `ep` ranks computes (moe_num_experts / ep experts of every MoE layer; it holds
    them all, neox/parallel/expert.py)."""
    experts = sum(moe_matrix_sizes(cfg)[1:]) - sum(moe_matrix_sizes(cfg, 0)[1:])
    return experts * sum(moe_layers(cfg)) // ep


def expected_ranks(cfg: ModelConfig, ep: int) -> float:
    """Ranks of an expert-parallel group of `ep` that a token's top-k choices reach, on average
    under uniform routing (k distinct experts of E, E / ep on each rank): ep (1 - q), q being
    the chance that none of the k lands on a given rank, C(E - E/ep, k) / C(E, k)."""
    e, k = cfg.moe_num_experts, cfg.moe_top_k
    return ep * (1 - math.comb(e - e // ep, k) / math.comb(e, k))


def all_to_all_bytes(cfg: ModelConfig, tokens: int, ep: int, element_bytes: int) -> int:
    """Bytes one rank sends in all-to-alls per step: per MoE layer, each of its `tokens` goes
    once to every rank its choices reach and comes back summed (neox/parallel/expert.py), out
    and back, forward and backward, less the rows that stay on the rank:
    4 x tokens x (ep - 1) / ep x expected_ranks x hidden x element_bytes per layer (the
    choices' metadata, ~10 bytes each, is left out)."""
    rows = tokens * expected_ranks(cfg, ep) * (ep - 1) / ep
    per_layer = 4 * rows * cfg.hidden_size * element_bytes
    return round(per_layer * sum(moe_layers(cfg)))
