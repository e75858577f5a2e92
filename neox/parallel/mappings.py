"""Tensor-parallel communication: one collective per autograd function, forward beside backward.

Each function's backward is the adjoint of its forward: the gradient of an identity that feeds
tp ranks is the sum of their gradients (all-reduce), the gradient of a sum is a copy, the
gradient of taking a slice is gathering the slices, and the other way round.
With a group of one rank every wrapper is the identity.

Inside a torch.compile'd graph the collectives are the functional (out-of-place) ones: dynamo
would trace the in-place `dist.all_reduce` as a copy_ into the tensor the forward returns, and
torch 2.11 then routes that autograd.Function's gradient to the wrong slot (pytorch issue
180642): a tp=2 run with torch_compile trained on wrong gradients from its first step on.
A traced collective's result comes back as a copy (`fresh`): the wait it passes through counts
as such a write too, and where an autograd.Function's forward returned it, torch 2.11's backends
that run dynamo's graph without AOTAutograd (`torch_compile_backend: eager`) misrouted its
gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def _world(group: Any) -> int:
    return dist.get_world_size(group=group)


def fresh(y: torch.Tensor) -> torch.Tensor:
    """A traced collective's waited result as a tensor of its own (see the module's docstring;
    inductor fuses the copy into the consumer)."""
    return y.clone()


def _all_reduce(x: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
    if torch.compiler.is_compiling():
        return fresh(funcol.all_reduce(x.contiguous(), op, group))
    x = x.contiguous().clone()  # collectives write in place; never into autograd's saved input
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op.upper()), group=group)
    return x


def all_reduce_max(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Elementwise max over the ranks of x, outside autograd (a softmax's stabilising shift,
    whose gradient is zero)."""
    x = x.detach()
    return x if _world(group) == 1 else _all_reduce(x, group, "max")


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = _world(group)
    if x.shape[-1] % world:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by tensor-parallel size {world}")
    rank = dist.get_rank(group=group)
    return x.chunk(world, dim=-1)[rank].contiguous()


def _gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The ranks' x concatenated along `dim`."""
    if torch.compiler.is_compiling():
        # Gathered along dim 0, then concatenated here: funcol's own gather along another dim
        # calls a helper torch 2.11's dynamo refuses to trace (a graph break at every gather).
        stacked = funcol.all_gather_tensor(x.contiguous(), 0, group)  # ranks along dim 0
        return torch.cat(stacked.chunk(_world(group), dim=0), dim=dim)
    parts = [torch.empty_like(x) for _ in range(_world(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _gather(x, x.dim() - 1, group)


def _seq_dim(x: torch.Tensor) -> int:
    return x.dim() - 2  # T of (B, T, C), or of a (T, C) position table; positive for funcol


def _split_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    world, dim = _world(group), _seq_dim(x)
    if x.shape[dim] % world:
        raise ValueError(
            f"sequence of {x.shape[dim]} tokens is not divisible by tensor-parallel size {world}"
        )
    return x.chunk(world, dim=dim)[dist.get_rank(group=group)].contiguous()


def _gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _gather(x, _seq_dim(x), group)


def _reduce_scatter_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    world, dim = _world(group), _seq_dim(x)
    if x.shape[dim] % world:
        raise ValueError(
            f"sequence of {x.shape[dim]} tokens is not divisible by tensor-parallel size {world}"
        )
    if torch.compiler.is_compiling():
        return fresh(funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, group))
    parts = [p.contiguous() for p in x.chunk(world, dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity (x enters every rank's shard). Backward: all-reduce dL/dx."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: all-reduce (sum the ranks' partial results). Backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the slices."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _GatherFromTensorParallel(torch.autograd.Function):
    """Forward: all-gather slices along the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Forward: all-gather the ranks' sequence chunks. Backward: reduce-scatter dL/dy (every
    rank's full-sequence gradient is partial; each keeps the sum over its own chunk)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Forward: sum the ranks' partial results, each rank keeping its sequence chunk.
    Backward: all-gather the chunks of dL/dy (the sum's gradient is a copy)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_sequence(grad, ctx.group), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Forward: keep this rank's sequence chunk. Backward: all-gather the chunks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_sequence(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """y = x on every rank; dL/dx = sum over ranks of dL/dy."""
    return x if _world(group) == 1 else _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """y = sum over ranks of x; dL/dx = dL/dy."""
    return x if _world(group) == 1 else _ReduceFromTensorParallel.apply(x, group)


def scatter_to_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """y = x[..., rank-th of tp equal slices]; dL/dx = concat of the ranks' dL/dy."""
    return x if _world(group) == 1 else _ScatterToTensorParallel.apply(x, group)


def gather_from_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """y = concat over ranks of x along the last dim; dL/dx = this rank's slice of dL/dy."""
    return x if _world(group) == 1 else _GatherFromTensorParallel.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """y = concat over ranks of x along T (dim -2); dL/dx = this rank's chunk of the sum over
    ranks of dL/dy."""
    return x if _world(group) == 1 else _GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """y = this rank's chunk along T (dim -2) of the sum over ranks of x; dL/dx = concat over
    ranks of dL/dy."""
    return x if _world(group) == 1 else _ReduceScatterToSequenceParallel.apply(x, group)


def scatter_to_sequence_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """y = x[..., rank-th of tp equal chunks of T, :]; dL/dx = concat of the ranks' dL/dy."""
    return x if _world(group) == 1 else _ScatterToSequenceParallel.apply(x, group)
