"""Expert parallelism: each MoE layer's experts computed on the ranks of an expert-parallel
group (moe_expert_parallel_size consecutive data-parallel ranks), tokens sent to the rank of
their expert and back by all-to-all.

Every rank keeps the whole stacked expert tensors and computes only its own E / ep experts, so a
rank's gradient of another rank's expert is zero and the data-parallel mean of the gradients is
exactly the single-rank one: each expert's gradient holds the contributions of all the group's
tokens on its owner. The weights, gradients and optimizer states are therefore reduced and
partitioned (ZeRO) like any other weight, and checkpoints do not depend on the EP size; what EP
saves is the expert compute and activations per rank, not the expert weights' memory.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from neox.model.moe import GroupedExperts, MoE, _Dispatch, _rows, narrow_ids, sum_choices
from neox.parallel.topology import ProcessGroups


class _AllToAll(torch.autograd.Function):
    """Rows of x to the group's ranks (send[i] rows to rank i); backward sends gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Differentiable all_to_all_single over `group` (gloo on CPU ranks, NCCL on GPUs)."""
    return _AllToAll.apply(x, send, recv, group)


class _RowSum(torch.autograd.Function):
    """rows (M, C), weights (M,) or None -> out (R, C), out[r] = the fp32 sum of weights[m] x
    rows[m] over the rows m of `owner` r, found through `cell` (kk, R): the kk rows of each r,
    M (a zero row) where it has fewer.

    Backward gathers each row's gradient from its owner (and, weighted, each weight's as a dot
    product) instead of autograd's way through the (kk, R, C) table: that one materialised the
    table's gradient, ~3.7x the rows with EP=4 at top-8, and took 10.9 ms a layer on an H200
    (docs/benchmarks.md, EP=4 on 2026-11-28 evening)."""

    @staticmethod
    def forward(ctx, rows, weights, owner, cell):
        kk, r = cell.shape
        table = _rows(rows, cell.reshape(-1), True).view(kk, r, rows.shape[-1])
        w = None
        if weights is not None:
            w = torch.cat([weights, weights.new_zeros(1)])[cell].t()  # (R, kk)
        ctx.save_for_backward(rows, weights, owner)
        return sum_choices(table, w)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, owner = ctx.saved_tensors
        g = grad[owner]  # (M, C)
        if weights is None:
            return g, None, None, None
        g = g.float()
        grad_rows = (g * weights.float()[:, None]).to(rows.dtype)
        grad_weights = (g * rows.float()).sum(-1).to(weights.dtype)
        return grad_rows, grad_weights, None, None


class ExpertDispatch:
    """MoE.dispatch under expert parallelism: rank r of the group runs experts
    [r E/ep, (r+1) E/ep) for the tokens of every rank in the group.

    A token goes once to each rank that holds one of its kept choices, not once per choice
    (top-8 of 64 experts on 4 ranks: ~3.66 rows instead of 8). Beside the rows, each choice
    sends its row's place in what the rank receives, its local expert and its router weight.
    The expert rank gathers a row per choice, runs the grouped GEMM sorted by expert, weighs
    each output and sums a row's choices in fp32, and sends one row back per (token, rank); the
    token's rank sums those. Every gather's backward is a gather and a sum (moe.py's _Dispatch,
    _RowSum here): no scatter-add, so the sums are deterministic. The counts are the one
    device-to-host copy of a layer's forward (all_to_all_single takes its split sizes on the
    host); backward has none.
    """

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def __call__(
        self,
        experts: GroupedExperts,
        tokens: torch.Tensor,
        choice: torch.Tensor,
        weights: torch.Tensor,
        keep: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """tokens (N, C), expert ids and router weights (N, k), keep (N, k) (None: every
        choice) -> sum over each token's kept choices of weight x expert output (N, C)."""
        ep, me = self.size, self.rank
        n, k = choice.shape
        local = experts.num_experts // ep
        dest = torch.div(choice, local, rounding_mode="floor")  # (N, k) ranks
        if keep is not None:
            dest = torch.where(keep, dest, ep)  # dropped: to a rank past the last, sent nowhere
        # sent[d, t]: token t goes to rank d (once, whatever its choices there).
        sent = torch.zeros(n, ep + 1, dtype=torch.long, device=tokens.device)
        sent = sent.scatter_(1, dest, 1)[:, :ep].t()  # (ep, N)
        rows = sent.sum(1)  # (ep,)
        ones = torch.ones(n * k, dtype=torch.long, device=tokens.device)
        picks = torch.zeros(ep + 1, dtype=torch.long, device=tokens.device)
        picks = picks.scatter_add_(0, dest.reshape(-1), ones)[:ep]  # (ep,) kept choices
        # Every rank's counts to every rank: table[s, d] = (rows, choices) rank s sends rank d.
        mine = torch.stack([rows, picks], 1).reshape(-1)
        table = torch.empty(ep * ep * 2, dtype=torch.long, device=tokens.device)
        dist.all_to_all_single(table, mine.repeat(ep), group=self.group)
        table = table.view(ep, ep, 2)
        sizes = table.tolist()  # the one device-to-host copy
        send = [sizes[me][d][0] for d in range(ep)]
        recv = [sizes[s][me][0] for s in range(ep)]
        send_picks = [sizes[me][d][1] for d in range(ep)]
        recv_picks = [sizes[s][me][1] for s in range(ep)]

        # The rows, by destination rank then token; table[d, t]: its row, sum(send) if unsent.
        flat = sent.reshape(-1)
        slot = flat.cumsum(0) - flat
        row_of = torch.where(flat.bool(), slot, sum(send))  # (ep N,)
        position = torch.empty(sum(send) + 1, dtype=torch.long, device=tokens.device)
        position = position.scatter_(0, row_of, torch.arange(ep * n, device=tokens.device))
        position = position[:-1]  # each row's (d, t) as d N + t
        x = _Dispatch.apply(tokens, position % n, row_of, True)  # (rows, C)
        # Where each row lands on its rank: after the rows of the ranks before this one.
        arrival = slot.view(ep, n) - (rows.cumsum(0) - rows)[:, None]
        arrival = arrival + table[:me, :, 0].sum(0)[:, None]  # (ep, N)

        # The choices, by destination rank then token: (arrival row, local expert), weight.
        pick = torch.argsort(narrow_ids(dest.reshape(-1), ep + 1), stable=True)
        pick = pick[: sum(send_picks)]  # the dropped ones sort last
        to = dest.reshape(-1)[pick]
        meta = arrival.reshape(-1)[to * n + pick // k] * local
        meta = meta + choice.reshape(-1)[pick] % local
        meta_in = meta.new_empty(sum(recv_picks))
        dist.all_to_all_single(meta_in, meta, recv_picks, send_picks, group=self.group)
        w = all_to_all(weights.reshape(-1).gather(0, pick), send_picks, recv_picks, self.group)
        arrived = all_to_all(x, send, recv, self.group)  # (sum(recv), C)

        out = self._run(experts, arrived, meta_in, w, k, local)
        back = all_to_all(out, recv, send, self.group)  # (rows, C)
        return _RowSum.apply(back, None, position % n, row_of.view(ep, n))

    def _run(
        self,
        experts: GroupedExperts,
        arrived: torch.Tensor,
        meta: torch.Tensor,
        weights: torch.Tensor,
        k: int,
        local: int,
    ) -> torch.Tensor:
        """This rank's experts on the rows that arrived (R, C), one pass per choice (meta: the
        choice's row x local + local expert; its weight), weighed and summed per row in fp32
        -> (R, C)."""
        r, device = arrived.shape[0], arrived.device
        row, expert = meta // local, meta % local  # rows ascending: sources, then tokens
        picks = row.numel()
        # A row's choices are contiguous: each one's place among them, 0 .. kk - 1.
        per_row = torch.zeros(r, dtype=torch.long, device=device)
        per_row = per_row.scatter_add_(0, row, torch.ones_like(row))
        place = torch.arange(picks, device=device) - (per_row.cumsum(0) - per_row)[row]
        kk = min(k, local)
        at = place * r + row  # each choice's cell in a (kk, R) table
        order = torch.argsort(narrow_ids(expert, local), stable=True)  # by local expert
        counts = torch.zeros(local, dtype=torch.long, device=device)
        counts = counts.scatter_add_(0, expert, torch.ones_like(expert))
        sorted_at = at[order]
        # cell -> the choice's place in expert order; picks (a zero row) where empty.
        cell = torch.full((kk * r,), picks, dtype=torch.long, device=device)
        cell = cell.scatter_(0, sorted_at, torch.arange(picks, device=device))
        owner = row[order]
        x = _Dispatch.apply(arrived, owner, cell, True)  # (picks, C) by expert
        out = experts(x, counts, first=self.rank * local)
        return _RowSum.apply(out, weights.gather(0, order), owner, cell.view(kk, r))


def expert_group_ranks(groups: ProcessGroups, ep: int) -> list[list[int]]:
    """Every expert-parallel group: each data-parallel group cut into runs of ep ranks."""
    return [dp[i : i + ep] for dp in groups.topo.data_group_ranks() for i in range(0, len(dp), ep)]


def apply_expert_parallel(model: nn.Module, groups: ProcessGroups, ep: int) -> None:
    """Give every MoE layer of `model` this rank's ExpertDispatch (collective: every rank calls
    it, as it creates the groups)."""
    mine = None
    for ranks in expert_group_ranks(groups, ep):
        group = dist.new_group(ranks=ranks)
        if groups.global_rank in ranks:
            mine = ExpertDispatch(group, ep, ranks.index(groups.global_rank))
    assert mine is not None
    for module in model.modules():
        if isinstance(module, MoE):
            module.dispatch = mine
