"""Tensor-parallel layers: Megatron's column/row-split linears, vocab-split embedding and loss.

Every layer takes its process group explicitly and holds only its own shard. `load_full_` copies
this rank's slice out of the full (tp=1) tensor, so a sharded model starts from exactly the
weights of the dense one.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from neox.parallel.mappings import (
    all_reduce_max,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from neox.parallel.sequence_linear import sequence_parallel_linear


def mark_tensor_parallel(param: nn.Parameter, dim: int) -> nn.Parameter:
    """Tag a sharded parameter: DeepSpeed counts it on every tp rank in gradient norms."""
    param.tensor_model_parallel = True
    param.model_parallel = True  # the older DeepSpeed/Megatron spelling, read by some paths
    param.partition_dim = dim
    return param


def remark_tensor_parallel(model: nn.Module) -> None:
    """Re-tag sharded parameters from their layers' PARTITION_DIMS.

    Module.to_empty (meta -> cpu/cuda) replaces Parameter objects and drops their attributes.
    """
    for module in model.modules():
        for name, dim in getattr(module, "PARTITION_DIMS", {}).items():
            param = getattr(module, name, None)
            if param is not None:
                mark_tensor_parallel(param, dim)


def shard(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """The rank-th of `world` equal contiguous slices of `full` along `dim`."""
    if full.shape[dim] % world:
        raise ValueError(f"dim {dim} of shape {tuple(full.shape)} is not divisible by tp={world}")
    return full.chunk(world, dim=dim)[rank]


def _rank_world(group: Any) -> tuple[int, int]:
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def _param(shape: tuple[int, ...], device: Any, dtype: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


def replicated_share(x: torch.Tensor, world: int) -> torch.Tensor:
    """This rank's share x / world of a tensor x that every rank holds (a bias, an adapter's
    output), added to partial sums that the caller all-reduces: the shares sum to x.

    The gradient passes through whole, not divided by world: the all-reduce's backward hands
    every rank all of dL/dsum, the same on each, and a replicated x must get on every rank its
    whole gradient (the sum of the ranks' 1/world), as in the unsplit model. Written as plain
    ops (x less the detached rest), which any dynamo traces, rather than an autograd.Function.
    """
    if world == 1:
        return x
    return x - x.detach() * ((world - 1) / world)


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns, A = [A_1 ... A_p]: rank i computes Y_i = X A_i + b_i.

    The input is replicated; the output stays split along its last dim unless gather_output.
    With sequence_parallel the input arrives already gathered over the sequence (the norm before
    the layer all-gathers it, and that gather's backward reduce-scatters the input gradient); the
    layer saves only this rank's chunk of it and re-gathers that in backward
    (neox/parallel/sequence_linear.py).
    """

    PARTITION_DIMS = {"weight": 0, "bias": 0}
    # The local matmul; neox/model/transforms/float8.py sets a float8 one on chosen instances.
    linear = staticmethod(F.linear)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Any,
        bias: bool = True,
        gather_output: bool = False,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.rank, self.world = _rank_world(group)
        self.sequence_parallel = sequence_parallel
        if out_features % self.world:
            raise ValueError(f"out_features={out_features} is not divisible by tp={self.world}")
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = out_features // self.world
        self.gather_output = gather_output
        self.weight = mark_tensor_parallel(
            _param((self.out_per_rank, in_features), device, dtype), 0
        )
        self.bias = (
            mark_tensor_parallel(_param((self.out_per_rank,), device, dtype), 0) if bias else None
        )

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Copy this rank's rows of the full (out, in) weight and its slice of the bias."""
        self.weight.copy_(shard(weight, 0, self.rank, self.world))
        if self.bias is not None and bias is not None:
            self.bias.copy_(shard(bias, 0, self.rank, self.world))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        if not self.sequence_parallel:
            x = copy_to_tensor_parallel(x, self.group)
        elif linear is ColumnParallelLinear.linear:  # not float8's, which saves its own input
            linear = functools.partial(sequence_parallel_linear, group=self.group)
        y = linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} ({self.out_per_rank}/rank)"


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows, A = [A_1; ...; A_p], X = [X_1 ... X_p]: Y = sum_i X_i A_i + b.

    Rank i holds A_i and (when input_is_parallel) receives X_i from a column-parallel layer; the
    partial products are all-reduced and the replicated bias is added once, after the sum.
    With sequence_parallel they are reduce-scattered along the sequence instead: each rank keeps
    the sum for its 1/p of the tokens, so the bias sees only those (its gradient is partial,
    summed over the tp ranks by apply_tensor_parallel's hooks: `tp_partial_grads`).
    With parallel_output (not with sequence_parallel) nothing is reduced: rank i returns its share
    Y_i = X_i A_i + b/p of Y (sum_i Y_i = Y) and the caller all-reduces it, after adding other
    shares (a parallel-residual block reduces its two branches at once: apply_tensor_parallel).
    """

    PARTITION_DIMS = {"weight": 1}
    linear = staticmethod(F.linear)  # as ColumnParallelLinear.linear

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Any,
        bias: bool = True,
        input_is_parallel: bool = True,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.rank, self.world = _rank_world(group)
        self.sequence_parallel = sequence_parallel
        self.parallel_output = False  # set by apply_tensor_parallel (_reduce_branches_once)
        if in_features % self.world:
            raise ValueError(f"in_features={in_features} is not divisible by tp={self.world}")
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = in_features // self.world
        self.input_is_parallel = input_is_parallel
        self.weight = mark_tensor_parallel(
            _param((out_features, self.in_per_rank), device, dtype), 1
        )
        self.bias = _param((out_features,), device, dtype) if bias else None
        if sequence_parallel and bias:
            self.tp_partial_grads = ("bias",)

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Copy this rank's columns of the full (out, in) weight; the bias is replicated."""
        self.weight.copy_(shard(weight, 1, self.rank, self.world))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.group)
        y = self.linear(x, self.weight)  # X_i A_i
        if self.parallel_output:
            return y if self.bias is None else y + replicated_share(self.bias, self.world)
        reduce = (
            reduce_scatter_to_sequence_parallel
            if self.sequence_parallel
            else reduce_from_tensor_parallel
        )
        y = reduce(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features} ({self.in_per_rank}/rank), out={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """E[ids] with the table split by vocab rows: rank i looks up ids in [iV/p, (i+1)V/p), zeros
    elsewhere, and the all-reduce sums the one non-zero row per token (with sequence_parallel a
    reduce-scatter: each rank keeps its 1/p of the tokens)."""

    PARTITION_DIMS = {"weight": 0}

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: Any,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.rank, self.world = _rank_world(group)
        self.sequence_parallel = sequence_parallel
        if num_embeddings % self.world:
            raise ValueError(
                f"vocabulary {num_embeddings} is not divisible by tp={self.world}; pad it with "
                f"make_vocab_size_divisible_by"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = num_embeddings // self.world
        self.vocab_start = self.rank * self.per_rank
        self.weight = mark_tensor_parallel(_param((self.per_rank, embedding_dim), device, dtype), 0)

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full (vocab, hidden) table."""
        self.weight.copy_(shard(weight, 0, self.rank, self.world))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, self.group)
        return reduce_from_tensor_parallel(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} ({self.per_rank}/rank), {self.embedding_dim}"


def vocab_parallel_logits(
    hidden: torch.Tensor, weight_shard: torch.Tensor, group: Any
) -> torch.Tensor:
    """Logits shard Z_i = H W_i^T for a vocab-split table W (tied head): H enters every rank."""
    return F.linear(copy_to_tensor_parallel(hidden, group), weight_shard)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Any
) -> torch.Tensor:
    """Per-token cross entropy -log softmax(z)[target] from this rank's vocab shard of z (B, T, V/p).

    Equals F.cross_entropy(full logits, target, reduction="none") on every rank.
    """
    if dist.get_world_size(group=group) == 1:
        return F.cross_entropy(
            logits.float().flatten(0, -2), target.flatten(), reduction="none"
        ).view_as(target)
    return sharded_cross_entropy(logits, target, group)


def sharded_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
    """loss = m + log sum_r exp(lse_r - m) - z_target, where lse_r = log sum_v exp(z_v) over rank
    r's vocab shard and m = max_r lse_r; the logits are never gathered. The vocab-parallel math
    on any group, one rank included (benchmarks time it so).

    Plain ops and traceable collectives, so torch.compile fuses the fp32 cast, max, exp and sum
    with the backward autograd derives. Three all-reduces of (B, T) tensors: the max m (no
    gradient: the loss does not depend on it), the target logit (held by one rank, 0 elsewhere)
    and the sum of exponentials. Both sums' backward is the identity, so autograd gives
    dL/dz_i = softmax(z)_i - onehot(target)_i from local values alone.

    Each shard's own logsumexp comes before the max's all-reduce, and the target logit is read
    from the same fp32 z: written otherwise (the max of the logits all-reduced between the cast
    and the exp, or the target read from the logits), AOTAutograd's partitioner (torch 2.13)
    saved an fp32 (tokens x vocab) tensor for backward instead of the logits.
    """
    per_rank = logits.shape[-1]
    local = target - dist.get_rank(group=group) * per_rank
    outside = (local < 0) | (local >= per_rank)
    z = logits.float()
    held = z.gather(-1, local.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)
    z_target = reduce_from_tensor_parallel(held.masked_fill(outside, 0.0), group)
    lse = torch.logsumexp(z, dim=-1)
    m = all_reduce_max(lse, group)
    sum_exp = reduce_from_tensor_parallel((lse - m).exp(), group)
    return m + sum_exp.log() - z_target
