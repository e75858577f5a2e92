"""Tensor parallelism applied from outside the plain GPTNeoX: swap named modules, shard weights.

`apply_tensor_parallel` walks the model and replaces the modules named in TENSOR_PARALLEL_PLAN
with Megatron's column/row/vocab-parallel layers, sets each attention's per-rank head counts,
and makes the tied (or column-split) output head produce vocab-sharded logits. Initialising
with `init_tensor_parallel` slices every sharded parameter out of the full init_parameter
tensor of the same name, so a tp=2 model starts from exactly the tp=1 weights.

With `groups.sequence_parallel` (Megatron's sequence parallelism) the regions between the
tensor-parallel linears (norms, residual adds, dropout, the embedding's output) hold 1/tp of the
sequence on each tp rank: the embedding and the row-parallel linears reduce-scatter along the
sequence instead of all-reducing, and each norm that feeds a tensor-parallel region (attention,
MLP, head) all-gathers its output, whose backward reduce-scatters; the column-parallel linears
(and the head) reading it save only this rank's chunk (sequence_linear.py). The parameters used on a
chunk of the tokens (norm weights and biases, row-parallel biases) get their gradients summed
over the tp ranks by a hook. The weights are those of the model without it.

Without sequence parallelism a parallel-residual block (gpt_j_residual) all-reduces once, as
gpt-neox does: x + drop(attn) + drop(mlp) is linear in the two row-parallel outputs, so each
returns this rank's share unreduced and the block reduces their sum (`_reduce_branches_once`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from neox.config.model import ModelConfig
from neox.model.block import Block
from neox.model.init import init_parameter
from neox.model.loss import masked_mean
from neox.model.mlp import MLP
from neox.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    remark_tensor_parallel,
    shard,
    vocab_parallel_cross_entropy,
)
from neox.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    reduce_from_tensor_parallel,
    scatter_to_sequence_parallel,
)
from neox.parallel.sequence_linear import mark_gathered, sequence_parallel_linear
from neox.parallel.topology import ProcessGroups

logger = logging.getLogger(__name__)

# Module name suffix -> how it is split. Column: output features split (heads, MLP width);
# row: input features split, partial sums all-reduced; vocab: embedding rows split.
TENSOR_PARALLEL_PLAN: dict[str, str] = {
    "attention.query_key_value": "column",
    "attention.dense": "row",
    "mlp.dense_h_to_4h": "column",
    "mlp.gate": "column",
    "mlp.dense_4h_to_h": "row",
    "embed_in": "vocab",
    "embed_out": "column",
}

# The DeepSpeed tracker's name for the per-tp-rank stream (its activation checkpointing saves
# and restores exactly this tracker, so recomputed dropout masks match the forward ones).
MODEL_PARALLEL_RNG = "model-parallel-rng"


def _parallel_module(
    kind: str, module: nn.Module, group: Any, sequence_parallel: bool
) -> nn.Module:
    """The tp counterpart of one plain module, with the same shapes, on the same device."""
    if kind == "vocab":
        w = module.weight
        return VocabParallelEmbedding(
            *w.shape, group, device=w.device, dtype=w.dtype, sequence_parallel=sequence_parallel
        )
    assert isinstance(module, nn.Linear), f"{kind}-parallel needs nn.Linear, got {module!r}"
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    w = module.weight
    return cls(
        module.in_features,
        module.out_features,
        group,
        bias=module.bias is not None,
        device=w.device,
        dtype=w.dtype,
        sequence_parallel=sequence_parallel,
    )


def _plan_kind(name: str) -> Optional[str]:
    for suffix, kind in TENSOR_PARALLEL_PLAN.items():
        if name == suffix or name.endswith("." + suffix):
            return kind
    return None


def apply_tensor_parallel(
    model: nn.Module,
    groups: ProcessGroups,
    cfg: Optional[ModelConfig] = None,
    copy_weights: bool = True,
) -> nn.Module:
    """Shard `model` (a GPTNeoX, a Block or any part of one) over groups.tensor, in place;
    over the sequence too between the linears when groups.sequence_parallel.

    Args:
        copy_weights: slice the current full weights into the shards (off for meta models,
            which are initialised afterwards with init_tensor_parallel).
    """
    tp = groups.get_tensor_model_parallel_world_size()
    if tp == 1:
        return model
    group = groups.tensor
    rank = groups.get_tensor_model_parallel_rank()
    sequence_parallel = getattr(groups, "sequence_parallel", False)
    cfg = cfg if cfg is not None else getattr(model, "cfg", None)
    if cfg is not None and cfg.output_layer_parallelism != "column":
        raise ValueError(
            f"output_layer_parallelism={cfg.output_layer_parallelism!r} is not supported with "
            f"model_parallel_size={tp}; use 'column' (logits stay split by vocabulary)"
        )
    targets = [(n, m) for n, m in model.named_modules() if n and _plan_kind(n)]
    for name, module in targets:
        if module is None:
            continue
        new = _parallel_module(_plan_kind(name), module, group, sequence_parallel)
        if copy_weights and module.weight.device.type != "meta":
            if isinstance(new, VocabParallelEmbedding):
                new.load_full_(module.weight)
            else:
                new.load_full_(module.weight, module.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)

    for _, module in model.named_modules():
        if hasattr(module, "query_key_value") and hasattr(module, "num_kv_heads"):
            _shard_attention(module, rank, tp)
    if sequence_parallel:
        _shard_sequence(model, group)
    else:
        for module in model.modules():
            if isinstance(module, Block):
                _reduce_branches_once(module, group)

    # The head reads embed_in.weight (tied) or embed_out.weight as F.linear(norm(x), W): with
    # W split by vocab rows the hidden state enters every rank, so its gradient is the sum
    # over ranks; the copy on the final norm's output supplies that all-reduce (under sequence
    # parallelism the gather's reduce-scatter does, and each rank gets its chunk's sum).
    norm = getattr(model, "final_layer_norm", None)
    if norm is not None:
        if sequence_parallel:
            _wrap_forward(norm, _gathered(group))
            _mark_partial(norm)
            if getattr(model, "head_linear", False) is None:  # float8's saves its own input
                model.head_linear = functools.partial(sequence_parallel_linear, group=group)
        else:
            _wrap_forward(norm, lambda fwd, *a, **k: copy_to_tensor_parallel(fwd(*a, **k), group))
    if not any(p.is_meta for p in model.parameters()):
        sum_partial_grads(model, group)  # meta models: init_tensor_parallel does it
    if hasattr(model, "lm_loss"):
        # The head now yields this rank's vocab slice of the logits.
        model.lm_loss = functools.partial(lm_loss_parallel, group=group)
    return model


def _shard_attention(attn: nn.Module, rank: int, tp: int) -> None:
    """Per-rank head counts: the qkv column split gave this rank whole kv groups."""
    attn.num_heads //= tp
    attn.num_kv_heads //= tp
    slopes = getattr(attn, "alibi_slopes", None)
    if slopes is not None:
        n = attn.num_heads
        attn.alibi_slopes = list(slopes)[rank * n : (rank + 1) * n]


def _reduce_branches_once(block: Block, group: Any) -> None:
    """One all-reduce for a parallel-residual block's two row-parallel outputs instead of one
    each: attention.dense and mlp.dense_4h_to_h return this rank's share (X_i A_i + b/tp) and the
    block adds x to the all-reduced sum of the dropped shares,
        x + reduce(drop(a_i + b_a/tp) + drop(m_i + b_m/tp)) = x + drop(a + b_a) + drop(m + b_m),
    exact at any hidden_dropout: dropout is linear for a fixed mask, and the hidden dropout of a
    whole (not sequence-chunked) tensor draws the same mask on every tp rank (the default
    generator, equal over tp ranks; use_tensor_parallel_rng forks only attention's). Backward,
    the reduce passes each share the whole output gradient, as the two reduces did.

    Not for a mixture-of-experts MLP (no row-parallel output) nor under sequence parallelism,
    whose row-parallel layers reduce-scatter (apply_tensor_parallel does not call this there).
    A LoRA adapter on either layer adds its output as a share too (neox/model/transforms/lora.py).
    """
    if not block.parallel_residual or not isinstance(block.mlp, MLP):
        return
    rows = (block.attention.dense, block.mlp.dense_4h_to_h)
    if not all(isinstance(m, RowParallelLinear) for m in rows):
        return
    for row in rows:
        row.parallel_output = True
    block.add_branches = functools.partial(_add_reduced, group)


def _add_reduced(
    group: Any, x: torch.Tensor, attn: torch.Tensor, mlp: torch.Tensor
) -> torch.Tensor:
    return x + reduce_from_tensor_parallel(attn + mlp, group)


def _shard_sequence(model: nn.Module, group: Any) -> None:
    """Sequence parallelism around the swapped layers: each block's norms hand their attention
    and MLP the whole sequence, learned positions are cut to this rank's chunk (the token
    embedding's reduce-scatter already is), and dropout on a chunk is marked to draw from the
    tp rank's own stream (use_tensor_parallel_rng)."""

    gathered = _gathered(group)
    for module in model.modules():
        if isinstance(module, Block):
            for norm in (module.input_layernorm, module.post_attention_layernorm):
                if norm is not None:
                    _wrap_forward(norm, gathered)
                    _mark_partial(norm)
            module.hidden_dropout.on_sequence_chunk = True
    pos = getattr(model, "embed_pos", None)
    if pos is not None:
        _wrap_forward(pos, lambda fwd, *a, **k: scatter_to_sequence_parallel(fwd(*a, **k), group))
    if getattr(model, "emb_dropout", None) is not None:
        model.emb_dropout.on_sequence_chunk = True


def _gathered(group: Any) -> Callable[..., torch.Tensor]:
    """A forward wrapper: the module's output (this rank's chunk) all-gathered over the
    sequence, tagged with the chunk so the column-parallel linears reading it save only that."""

    def gathered(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        chunk = forward(*args, **kwargs)
        return mark_gathered(gather_from_sequence_parallel(chunk, group), chunk)

    return gathered


def _mark_partial(module: nn.Module) -> None:
    """Its parameters see one chunk of the tokens on each tp rank: their gradients are partial."""
    module.tp_partial_grads = tuple(name for name, _ in module.named_parameters())


def sum_partial_grads(model: nn.Module, group: Any) -> None:
    """Parameters whose gradient on each tp rank is only part of the dense model's get it summed
    over the tp ranks, so every rank holds the dense model's gradient (and the same weights after
    the step): the q/k norms of each attention (use_qk_layernorm), one weight shared by all
    heads, which see only this rank's heads; under sequence parallelism the parameters a module
    names in `tp_partial_grads` (norms, row-parallel biases), which see only this rank's tokens.
    Call on materialised parameters: a hook on a meta parameter is lost when `to_empty`
    replaces it."""
    hook = functools.partial(_sum_over_ranks, group=group)
    for _, module in model.named_modules():
        for name in ("q_layernorm", "k_layernorm"):
            norm = getattr(module, name, None)
            if isinstance(norm, nn.Module) and hasattr(module, "num_kv_heads"):
                for param in norm.parameters():
                    param.register_hook(hook)
        for name in getattr(module, "tp_partial_grads", ()):
            getattr(module, name).register_hook(hook)


def _sum_over_ranks(grad: torch.Tensor, group: Any) -> torch.Tensor:
    """A replicated parameter's gradient from partial ones: the sum over the tp group."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def _wrap_forward(module: nn.Module, wrapper: Callable[..., Any]) -> None:
    """module.forward = wrapper(original forward, ...), on this instance only (names unchanged)."""
    original = module.forward
    module.forward = functools.partial(wrapper, original)


@torch.no_grad()
def init_tensor_parallel(
    module: nn.Module,
    cfg: ModelConfig,
    seed: int,
    groups: Optional[ProcessGroups] = None,
    prefix: str = "",
    device: Any = "cpu",
) -> nn.Module:
    """Materialise a (meta) module on `device`, each parameter = its shard of init_parameter(name).

    Args:
        prefix: the module's name inside the plain GPTNeoX ("layers.3."), so init is by full name.
    """
    tp = 1 if groups is None else groups.get_tensor_model_parallel_world_size()
    if any(p.is_meta for p in module.parameters()):
        module.to_empty(device=device)
        remark_tensor_parallel(module)
        if tp > 1:
            sum_partial_grads(module, groups.tensor)
    rank = 0 if groups is None else groups.get_tensor_model_parallel_rank()
    for name, param in module.named_parameters():
        dim = getattr(param, "partition_dim", None)
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            full_shape = list(param.shape)
            full_shape[dim] *= tp
            full = init_parameter(prefix + name, full_shape, cfg, seed)
            param.copy_(shard(full, dim, rank, tp))
        else:
            param.copy_(init_parameter(prefix + name, param.shape, cfg, seed))
    return module


def seed_parallel_rng(seed: int, groups: ProcessGroups) -> None:
    """Default generator: seed + 100 * stage (equal over tp and dp ranks); the tracker's
    model-parallel stream: seed + 2718 + tp_rank (differs over tp ranks, for dropout on shards)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    base = seed + 100 * groups.get_pipe_parallel_rank()
    torch.manual_seed(base)
    get_accelerator().manual_seed(base)
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, base + 2718 + groups.get_tensor_model_parallel_rank())


def fork_tensor_parallel_rng() -> contextlib.AbstractContextManager:
    """Context in which random ops draw from this tp rank's own stream."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    return get_cuda_rng_tracker().fork(MODEL_PARALLEL_RNG)


def use_tensor_parallel_rng(model: nn.Module) -> None:
    """Run every attention forward (whose only randomness, attention dropout, acts on this
    rank's heads) under the tp rank's own RNG stream, and under sequence parallelism the dropout
    on a chunk of the sequence (the same stream on every rank would repeat one mask over the tp
    chunks); other hidden dropout stays shared.

    Without dropout there is nothing to draw, and no fork: swapping RNG states is a graph
    break that would split every compiled block in three."""
    for _, module in model.named_modules():
        is_attention = hasattr(module, "query_key_value") and hasattr(module, "num_kv_heads")
        if is_attention and getattr(module, "dropout", 0.0) > 0:
            _wrap_forward(module, _forward_in_tp_rng)
        chunked = getattr(module, "on_sequence_chunk", False)
        if chunked and isinstance(module, nn.Dropout) and module.p > 0:
            _wrap_forward(module, _forward_in_tp_rng)


def _forward_in_tp_rng(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with fork_tensor_parallel_rng():
        return forward(*args, **kwargs)


def lm_loss_parallel(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: Optional[torch.Tensor],
    group: Any,
) -> torch.Tensor:
    """Masked mean over tokens of -log softmax(z)[label], z split over `group` by vocabulary."""
    return masked_mean(vocab_parallel_cross_entropy(logits, labels, group), loss_mask)
