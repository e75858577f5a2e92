"""Context parallelism (context_parallel_size): each sample's sequence split over cp ranks.

Outside attention every layer is per-token, so each rank runs embeddings, norms, MLP and loss on
its own chunk of T / cp tokens. Attention is the one place a token reads other tokens; there the
cp ranks swap a head split for the sequence split with one all-to-all (DeepSpeed-Ulysses): each
rank then holds heads / cp heads over the *whole* sequence, runs the layer's usual kernel (the
causal, sliding-window and packed-document masks, GQA and ALiBi unchanged, since it sees every
key), and a second all-to-all brings its chunk's tokens back with all heads. q, k and v travel
packed in one buffer, so a layer makes two all-to-alls forward and two backward. The attention is
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
collective (torch.distributed.all_to_all_single, which gloo has on CPU ranks too). Inside a
compiled block it is the functional all_to_all_single instead, which dynamo traces into the
block's graph (as neox/parallel/mappings.py does for tensor parallelism): no graph break.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from neox.data.batch import Batch
from neox.model.attention import Attention


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x (cp, ...): piece i goes to rank i of `group`; the result's piece j came from rank j."""
    x = x.contiguous()  # a no-op for the packed buffers; a gradient may come strided
    if torch.compiler.is_compiling():
        # Functional (out-of-place) collective: traced into the compiled graph, no break.
        return funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group))
    recv = torch.empty_like(x)
    dist.all_to_all_single(recv, x, group=group)
    return recv


class _AllToAll(torch.autograd.Function):
    """The exchange of a (cp, ...) buffer; it is its own adjoint, so backward exchanges the
    gradient the same way (each piece goes back to the rank it came from)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


class UlyssesExchange:
    """What an Attention calls around its kernel under context parallelism (Attention's
    `context_parallel` attribute). A layer's forward makes two all-to-alls (q, k and v packed
    in one, the output in the other), its backward two; each packs or unpacks with one copy."""

    def __init__(self, group: Any, cp: int) -> None:
        self.group, self.cp = group, cp

    def scatter_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, nh, T/cp, hs), k and v (B, nkv, T/cp, hs) -> the full sequence, heads / cp.

        Rank i is sent its share of q's heads, then of k's, then of v's, in one buffer
        (cp, B, (nh + 2 nkv) / cp, T/cp, hs): GQA with nkv divisible by cp sends only its kv
        heads."""
        cp = self.cp
        B, nh, t, hs = q.shape
        nkv = k.shape[1]
        if nkv % cp:
            # Too few kv heads to share out (GQA/MQA): one per query head, as MHA.
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
            nkv = nh
        shares = [z.view(B, cp, z.shape[1] // cp, t, hs).transpose(0, 1) for z in (q, k, v)]
        send = torch.cat(shares, dim=2)  # (cp, B, (nh + 2 nkv) / cp, t, hs): the one copy in
        recv = _AllToAll.apply(send, self.group)  # piece j: rank j's tokens, my heads
        heads = recv.shape[2]
        whole = recv.permute(1, 2, 0, 3, 4).reshape(B, heads, cp * t, hs)  # the one copy out
        return tuple(whole.split([nh // cp, nkv // cp, nkv // cp], dim=1))  # type: ignore

    def gather_heads(self, y: torch.Tensor) -> torch.Tensor:
        """The kernel's output (B, nh/cp, T, hs) -> (B, nh, T/cp, hs), a transposed view of a
        contiguous (B, T/cp, nh, hs), so the layer's reshape to (B, T/cp, nh * hs) is free."""
        cp = self.cp
        B, h, T, hs = y.shape
        send = y.view(B, h, cp, T // cp, hs).permute(2, 0, 1, 3, 4)  # (cp, B, h, T/cp, hs)
        recv = _AllToAll.apply(send, self.group)  # piece j: rank j's heads
        out = recv.permute(1, 3, 0, 2, 4).reshape(B, T // cp, cp * h, hs)  # (B, T/cp, nh, hs)
        return out.transpose(1, 2)


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
