"""Context parallelism (context_parallel_size): each sample's sequence split over cp ranks.

Outside attention every layer is per-token, so each rank runs embeddings, norms, MLP and loss on
its own chunk of T / cp tokens. Attention is the one place a token reads other tokens; there the
cp ranks swap a head split for the sequence split with one all-to-all (DeepSpeed-Ulysses): each
rank then holds heads / cp heads over the *whole* sequence, runs the layer's usual kernel (the
causal, sliding-window and packed-document masks, GQA and ALiBi unchanged, since it sees every
key), and a second all-to-all brings its chunk's tokens back with all heads. The attention is
exact and every rank does the same work, so no causal load balancing is needed. Its limit is
heads: (heads per tensor-parallel rank) must divide by cp, checked with the config; key/value
heads that do not divide are replicated to one per query head before the exchange.

Positions and the document mask are computed from the full sequence before it is cut
(`context_chunk`), so rotary and reset_position_ids use global positions. Gradients: the cp ranks
hold the same weights, so the engines reduce gradients over data x context (ProcessGroups'
gradient group) and each rank's loss weight counts its own trained tokens over the global count
(neox.training.engine.weigh_micro_batches): each trained token counts once.

Why our own all-to-all rather than DeepSpeed's DistributedAttention: that wraps one local
attention callable over (batch, seq, heads, dim) tensors, while neox's attention chooses among
four kernels per layer on (B, nh, T, hs) tensors after rotary; the exchange itself is one
collective (torch.distributed.all_to_all_single, which gloo has on CPU ranks too).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from neox.data.batch import Batch
from neox.model.attention import Attention
from neox.model.eager import eager_only


def _all_to_all(x: torch.Tensor, group: Any, scatter: int, gather: int) -> torch.Tensor:
    """Cut x into cp pieces along `scatter`, send piece i to rank i of `group`, and join the
    pieces received, in rank order, along `gather`."""
    cp = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter)).contiguous()  # (cp, *piece)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)


class _SeqAllToAll(torch.autograd.Function):
    """Forward: scatter dim `scatter`, gather dim `gather`; backward: the inverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, scatter: int, gather: int) -> torch.Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


# Compiled blocks (torch_compile) break their graph around the exchange: dynamo would otherwise
# trace a process-group collective inside an autograd.Function.
@eager_only
def heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(B, H, T/cp, hs) on each rank -> (B, H/cp, T, hs): the whole sequence, a share of heads."""
    return _SeqAllToAll.apply(x, group, 1, 2)


@eager_only
def sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(B, H/cp, T, hs) -> (B, H, T/cp, hs): this rank's chunk of the tokens, every head."""
    return _SeqAllToAll.apply(x, group, 2, 1)


class UlyssesExchange:
    """What an Attention calls around its kernel under context parallelism (Attention's
    `context_parallel` attribute)."""

    def __init__(self, group: Any, cp: int) -> None:
        self.group, self.cp = group, cp

    def scatter_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, nh, T/cp, hs), k and v (B, nkv, T/cp, hs) -> the full sequence, heads / cp."""
        nh, nkv = q.shape[1], k.shape[1]
        if nkv % self.cp:
            # Too few kv heads to share out (GQA/MQA): one per query head, as MHA.
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
        return tuple(heads_to_sequence(t, self.group) for t in (q, k, v))

    def gather_heads(self, y: torch.Tensor) -> torch.Tensor:
        """The kernel's output (B, nh/cp, T, hs) -> (B, nh, T/cp, hs)."""
        return sequence_to_heads(y, self.group)


def apply_context_parallel(model: nn.Module, groups: Any) -> None:
    """Give every attention layer the Ulysses exchange over the context-parallel group, and
    the layer's ALiBi slopes of the heads this rank attends with; a no-op at cp = 1."""
    cp = groups.get_context_parallel_world_size()
    if cp == 1:
        return
    rank = groups.get_context_parallel_rank()
    exchange = UlyssesExchange(groups.get_context_parallel_group(), cp)
    model.context_parallel_size = cp
    for module in model.modules():
        if isinstance(module, Attention):
            module.context_parallel = exchange
            if module.alibi_slopes is not None:  # after tensor parallelism's own split
                share = len(module.alibi_slopes) // cp
                module.alibi_slopes = module.alibi_slopes[rank * share : (rank + 1) * share]


def context_chunk(batch: Batch, rank: int, cp: int) -> Batch:
    """This rank's chunk (tokens [rank * T/cp, (rank+1) * T/cp)) of a micro-batch built from
    the full sequences: tokens, labels, loss mask and positions are cut; document ids stay
    whole, since attention sees the whole sequence."""
    if cp == 1:
        return batch
    T = batch.tokens.shape[1]
    if T % cp:
        raise ValueError(f"sequence of {T} tokens does not split into context_parallel_size={cp}")
    part = slice(rank * (T // cp), (rank + 1) * (T // cp))

    def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t[:, part].contiguous()

    return Batch(
        tokens=cut(batch.tokens),
        labels=cut(batch.labels),
        loss_mask=cut(batch.loss_mask),
        position_ids=cut(batch.position_ids),
        document_ids=batch.document_ids,
        loss_weight=batch.loss_weight,
    )
