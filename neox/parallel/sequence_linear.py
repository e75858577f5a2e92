"""Column-parallel linears that save this rank's sequence chunk of their input, not the gather.

Under sequence parallelism the norm before a tensor-parallel region all-gathers its output over
the sequence, and the column-parallel linears read that (B, T, C) tensor. F.linear would save it
for the weight gradient: a whole-sequence copy on every tp rank. Here the gathered tensor carries
the chunk it was gathered from (`mark_gathered`), the linear saves only that (B, T/tp, C) chunk
and all-gathers it again in backward (Megatron's sequence-parallel linear does the same). One
gather in forward serves every linear that reads it (SwiGLU's gate and up share the chunk too);
in backward each of those linears re-gathers it once. The input gradient each returns is the
whole sequence's: autograd sums them, and the norm's gather reduce-scatters the sum once.
Compiled, the re-gather is a functional collective that must stay in the backward graph (see
backward); tests/parallel/sequence_helpers.py checks that the graph saves no gathered input.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from neox.parallel.mappings import _gather_sequence

_CHUNK = "_neox_sequence_chunk"


def mark_gathered(full: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """Tag `full` (the all-gather of `chunk` over the sequence) with the chunk it came from."""
    setattr(full, _CHUNK, chunk)
    return full


class _LinearSavingChunk(torch.autograd.Function):
    """y = full @ W^T + b, saving `chunk` (this rank's part of full) instead of full."""

    @staticmethod
    def forward(ctx, full, chunk, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(chunk, weight)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        chunk, weight = ctx.saved_tensors
        grad_full = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[2]:
            if torch.compiler.is_compiling():
                # AOTAutograd's partitioner would run a gather of forward values in the forward
                # graph and save its output; a dependence on the gradient keeps it in backward.
                chunk = chunk + flat[:1, :1].sum().detach() * 0
            full = _gather_sequence(chunk, ctx.group)
            grad_weight = flat.t().matmul(full.reshape(-1, full.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = flat.sum(0)
        return grad_full, None, grad_weight, grad_bias, None


def sequence_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, group: Any
) -> torch.Tensor:
    """F.linear(x, weight, bias); when x was gathered over the sequence (mark_gathered) and
    autograd records, saving only this rank's chunk of x for the weight gradient."""
    chunk = getattr(x, _CHUNK, None)
    if chunk is None or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _LinearSavingChunk.apply(x, chunk, weight, bias, group)
