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

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from neox.model.moe import GroupedExperts, MoE, narrow_ids
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


class ExpertDispatch:
    """MoE.dispatch under expert parallelism: rank r of the group runs experts
    [r E/ep, (r+1) E/ep) for the tokens of every rank in the group."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor):
        """x (M, C) sorted by expert, counts (E,) -> the experts' outputs (M, C), same order;
        rows past counts.sum() (dropped past capacity) are not sent, and come back as zeros."""
        ep = self.size
        local = counts.numel() // ep
        # recv_counts[s, j]: rows rank s sends to this rank's local expert j.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)
        recv_counts = recv_counts.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        rows = x.shape[0]
        x = x[: sum(send)]
        arrived = all_to_all(x, send, recv, self.group)  # by source rank, then local expert
        expert = torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(ep), recv_counts.flatten()
        )
        # By local expert, then source rank.
        order = torch.argsort(narrow_ids(expert, local), stable=True)
        out = experts(arrived[order], recv_counts.sum(0), first=self.rank * local)
        back = torch.empty_like(out).index_copy_(0, order, out)
        out = all_to_all(back, recv, send, self.group)
        if rows == out.shape[0]:  # nothing dropped: no copy
            return out
        return torch.cat([out, out.new_zeros(rows - out.shape[0], out.shape[1])])


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
