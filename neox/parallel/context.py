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

context_parallel_chunks = G > 1 cuts a rank's heads into G groups exchanged apart
(`UlyssesExchange.attend_in_groups`): each all-to-all is started and waited for at different
points, so that group g+1's q, k, v and group g's output travel during group g's kernel, and the
gradients' in the same way during the backward.

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

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from neox.data.batch import Batch
from neox.model.attention import Attention
from neox.parallel.mappings import fresh


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x (cp, ...): piece i goes to rank i of `group`; the result's piece j came from rank j."""
    x = x.contiguous()  # a no-op for the packed buffers; a gradient may come strided
    if torch.compiler.is_compiling():
        # Functional (out-of-place) collective: traced into the compiled graph, no break.
        return fresh(funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group)))
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


class _Pending:
    """An eager exchange in flight: dist.all_to_all_single's work handle, set when it starts.
    Compiled, the functional collective's result tensor is the handle and this is None."""

    work: Any = None


def _start(x: torch.Tensor, group: Any, name: str, pending: Optional[_Pending]) -> torch.Tensor:
    """Start the exchange of x (cp, ...); its result may be read once _finish has waited."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        # The op itself: funcol.all_to_all_single waits at once when traced.
        splits = [1] * x.shape[0]
        return torch.ops._c10d_functional.all_to_all_single(x, splits, splits, name)
    recv = torch.empty_like(x)
    pending.work = dist.all_to_all_single(recv, x, group=group, async_op=True)
    return recv


def _finish(y: torch.Tensor, pending: Optional[_Pending]) -> torch.Tensor:
    """Wait for the exchange _start began (y: its result)."""
    if torch.compiler.is_compiling():
        return fresh(torch.ops._c10d_functional.wait_tensor(y))
    pending.work.wait()
    return y


class _StartAllToAll(torch.autograd.Function):
    """The first half of an exchange that overlaps what runs until _WaitAllToAll. Backward is
    the mirror: _WaitAllToAll's backward starts the gradient's exchange, this waits for it, so
    the backward that autograd runs between them (a group's kernel) overlaps it too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, name: str, pending: Optional[_Pending]):
        ctx.pending = pending
        return _start(x, group, name, pending)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _finish(grad, ctx.pending), None, None, None


class _WaitAllToAll(torch.autograd.Function):
    """The second half (see _StartAllToAll)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: Any, name: str, pending: Optional[_Pending]):
        ctx.group, ctx.name, ctx.pending = group, name, pending
        return _finish(y, pending)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _start(grad, ctx.group, ctx.name, ctx.pending), None, None, None


class UlyssesExchange:
    """What an Attention calls around its kernel under context parallelism (Attention's
    `context_parallel` attribute). At chunks 1 a layer's forward makes two all-to-alls (q, k and
    v packed in one, the output in the other), its backward two; each packs or unpacks with one
    copy. At chunks G > 1 the layer calls `attend_in_groups` instead: 2 G all-to-alls each way,
    overlapping the kernel of each group of heads."""

    def __init__(self, group: Any, cp: int, chunks: int = 1) -> None:
        self.group, self.cp, self.chunks = group, cp, chunks
        # Compiled blocks name the group to the functional collectives by this string.
        self.group_name = "" if group is None else group.group_name

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

    def attend_in_groups(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: Callable[..., Any]
    ) -> torch.Tensor:
        """scatter_heads, kernel, gather_heads with a rank's heads cut into `chunks` groups, so
        that the transfers overlap the kernel: every group's q, k, v exchange starts first;
        then each group waits for its own, runs `kernel(q, k, v, heads)` (heads: the slice of
        this rank's heads, for ALiBi's slopes) and starts its output's exchange before the next
        group's kernel; the outputs are waited for last. Autograd runs the backward in the
        mirror order. Same shapes in and out as scatter_heads and gather_heads.

        A group keeps its query heads' kv heads: with fewer kv heads a rank than groups, a kv
        head read by several groups travels with each; kv heads that neither divide into the
        groups nor the groups into them are replicated to one per query head first."""
        cp, G = self.cp, self.chunks
        B, nh, t, hs = q.shape
        h = nh // cp  # a rank's query heads
        if h % G:
            raise ValueError(f"context_parallel_chunks={G} does not divide a rank's {h} heads")
        r = k.shape[1] // cp  # a rank's kv heads
        if k.shape[1] % cp or (r % G and G % r):
            k = k.repeat_interleave(nh // k.shape[1], dim=1)  # one per query head, as MHA
            v = v.repeat_interleave(nh // v.shape[1], dim=1)
            r = h
        hg, kvg, per_kv = h // G, max(1, r // G), h // r  # a group's q and kv heads
        qs, ks, vs = (z.view(B, cp, z.shape[1] // cp, t, hs) for z in (q, k, v))
        pending = [None if torch.compiler.is_compiling() else _Pending() for _ in range(2 * G)]

        def start(send: torch.Tensor, p: Optional[_Pending]) -> torch.Tensor:
            return _StartAllToAll.apply(send, self.group, self.group_name, p)

        def wait(recv: torch.Tensor, p: Optional[_Pending]) -> torch.Tensor:
            return _WaitAllToAll.apply(recv, self.group, self.group_name, p)

        inbound = []
        for g in range(G):
            kv = g * hg // per_kv  # the group's first kv head
            parts = [
                qs[:, :, g * hg : (g + 1) * hg],
                ks[:, :, kv : kv + kvg],
                vs[:, :, kv : kv + kvg],
            ]
            send = torch.cat(
                [z.transpose(0, 1) for z in parts], dim=2
            )  # (cp, B, hg + 2 kvg, t, hs)
            inbound.append(start(send, pending[g]))
        outbound = []
        for g in range(G):
            recv = wait(inbound[g], pending[g])  # piece j: rank j's tokens, this group's heads
            whole = recv.permute(1, 2, 0, 3, 4).reshape(B, hg + 2 * kvg, cp * t, hs)
            qg, kg, vg = whole.split([hg, kvg, kvg], dim=1)
            y = kernel(qg, kg, vg, slice(g * hg, (g + 1) * hg))  # (B, hg, T, hs)
            send = y.view(B, hg, cp, t, hs).permute(2, 0, 1, 3, 4)  # (cp, B, hg, t, hs)
            outbound.append(start(send, pending[G + g]))
        # Piece j of group g: rank j's heads g * hg.. of its share, for this rank's tokens.
        back = [wait(y, pending[G + g]).permute(1, 3, 0, 2, 4) for g, y in enumerate(outbound)]
        out = torch.stack(back, dim=3).reshape(B, t, nh, hs)  # (B, t, cp, G, hg, hs) -> heads
        return out.transpose(1, 2)  # (B, nh, t, hs)


def apply_context_parallel(model: nn.Module, groups: Any, chunks: int = 1) -> None:
    """Give every attention layer the Ulysses exchange over the context-parallel group (in
    `chunks` head groups: context_parallel_chunks), and the layer's ALiBi slopes of the heads
    this rank attends with; a no-op at cp = 1."""
    cp = groups.get_context_parallel_world_size()
    if cp == 1:
        return
    rank = groups.get_context_parallel_rank()
    exchange = UlyssesExchange(groups.get_context_parallel_group(), cp, chunks)
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
