"""Mixture-of-experts MLP: a top-k router, experts as one grouped GEMM, auxiliary losses.

Parameter names (HF converters map these; the expert weights are stacked, nn.Linear's
(out, in) layout per expert):
  mlp.router.weight                       (E, C)
  mlp.experts.dense_h_to_4h               (E, F, C)
  mlp.experts.gate                        (E, F, C)  gated activations only
  mlp.experts.dense_4h_to_h               (E, C, F)
  mlp.shared_experts.{dense_h_to_4h,gate,dense_4h_to_h}.{weight,bias}   with shared experts
  mlp.shared_expert_gate.weight           (1, C)     with moe_shared_expert_gate
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from neox.config.model import ModelConfig
from neox.model.mlp import MLP, activation_act


@dataclass
class RouterStats:
    """One MoE layer's last forward: its auxiliary losses (with grad) and expert load."""

    balance_loss: torch.Tensor  # E * sum_e f_e P_e: 1 when perfectly balanced
    z_loss: torch.Tensor  # mean logsumexp(logits)^2
    load: torch.Tensor  # (E,) fraction of assignments per expert, detached
    dropped: torch.Tensor  # fraction of assignments dropped past capacity, detached
    # moe_loss_coeff x balance_loss + moe_z_loss_coeff x z_loss, with grad: weighed here, inside
    # a compiled block's graph, not in eager kernels of their own for every layer.
    aux: torch.Tensor


def sinkhorn(logits: torch.Tensor, iters: int = 100, tol: float = 1e-4) -> torch.Tensor:
    """exp(logits) (N, E) scaled by row and column factors until every expert column carries
    the same total (Sinkhorn-Knopp); only its ranking per row is used."""
    cost = torch.exp(logits - logits.max())
    n, e = cost.shape

    def going(i, col, row, done):
        return (i < iters) & ~done

    def step(i, col, row, done):
        row = 1.0 / (n * (cost @ col + 1e-8))
        new_col = 1.0 / (e * (row @ cost + 1e-8))
        return i + 1, new_col, row, (new_col - col).abs().mean() < tol

    # A loop that stops on a device value: torch.while_loop keeps it inside a compiled block's
    # graph (a Python `if` on the tensor would break the graph at every iteration).
    start = (
        torch.zeros((), dtype=torch.long, device=cost.device),
        torch.ones(e, dtype=cost.dtype, device=cost.device),
        torch.zeros(n, dtype=cost.dtype, device=cost.device),
        torch.zeros((), dtype=torch.bool, device=cost.device),
    )
    _, col, row, _ = torch.while_loop(going, step, start)
    return cost * row[:, None] * col[None, :]


class Router(nn.Module):
    """Scores each token's experts; returns the top-k weights and expert ids."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.moe_num_experts, cfg.moe_top_k
        deepspeed = cfg.moe_type == "deepspeed"  # DeepSpeed-MoE's gate: softmax top-k
        self.sinkhorn = cfg.moe_router_type == "sinkhorn" and not deepspeed
        default_score = "sigmoid" if self.sinkhorn else "softmax"
        self.score_func = cfg.moe_score_func or default_score
        self.norm_topk = cfg.moe_norm_topk_prob
        self.jitter = cfg.moe_jitter_eps
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, C) -> weights (N, k) in x's dtype, expert ids (N, k), scores and logits (N, E)
        in float32."""
        if self.training and self.jitter:
            eps = self.jitter
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        logits = F.linear(x, self.weight).float()
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if self.training and self.sinkhorn:
            with torch.no_grad():
                experts = sinkhorn(logits).topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, experts)
        else:
            weights, experts = scores.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return weights.to(x.dtype), experts, scores, logits


class GroupedExperts(nn.Module):
    """E MLPs as stacked weights, each applied to its contiguous run of sorted tokens."""

    def __init__(self, cfg: ModelConfig, ffn: int) -> None:
        super().__init__()
        e, h = cfg.moe_num_experts, cfg.hidden_size
        self.num_experts = e  # the weights' shapes are empty where ZeRO-3 partitions them
        self.act = activation_act(cfg)
        self.dense_h_to_4h = nn.Parameter(torch.empty(e, ffn, h))
        self.gate = nn.Parameter(torch.empty(e, ffn, h)) if cfg.shape.gated_mlp else None
        self.dense_4h_to_h = nn.Parameter(torch.empty(e, h, ffn))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, first: int = 0) -> torch.Tensor:
        """x (M, C) sorted by expert, counts (n,) tokens for experts first..first+n-1 -> (M, C).
        Rows past counts.sum() (assignments dropped past capacity) belong to no expert: their
        outputs are undefined (zeros on the padded path), and nothing reads them."""
        ffn = self.dense_h_to_4h.shape[1]
        if grouped_mm_runs(x) and ffn % 8 == 0 and x.shape[-1] % 8 == 0:
            offsets = counts.cumsum(0).to(torch.int32)
            mm = _grouped_mm(offsets)
        else:
            mm = _padded_bmm(counts)
        experts = slice(first, first + counts.numel())
        up = mm(x, self.dense_h_to_4h[experts])
        if self.gate is None:
            h = self.act(up)
        else:
            h = self.act(mm(x, self.gate[experts])) * up
        return mm(h, self.dense_4h_to_h[experts])


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """torch's grouped GEMM runs forward and backward on CUDA in bf16 (with widths that are
    multiples of 8: its rows must be 16-byte aligned); CPU ranks (and other dtypes) take the
    padded batched matmul, the same math."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


def _grouped_mm(offsets: torch.Tensor):
    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.grouped_mm(x, w.transpose(-2, -1), offs=offsets)  # (M, in) @ (E, in, out)

    return mm


def _padded_bmm(counts: torch.Tensor):
    """Tokens scattered into an (E, max count, in) buffer, one bmm, gathered back: no loop."""
    e = counts.numel()
    starts = counts.cumsum(0) - counts
    expert = torch.repeat_interleave(torch.arange(e, device=counts.device), counts)
    slot = torch.arange(expert.numel(), device=counts.device) - starts[expert]
    rows = int(counts.max()) if expert.numel() else 0

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m = expert.numel()  # rows past these were dropped: zeros
        buf = x.new_zeros(e, rows, x.shape[-1])
        buf[expert, slot] = x[:m]
        out = torch.bmm(buf, w.transpose(-2, -1))[expert, slot]
        if m == x.shape[0]:
            return out
        return torch.cat([out, out.new_zeros(x.shape[0] - m, out.shape[1])])

    return mm


def narrow_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """ids (each < n) in the narrowest integer dtype that holds them, to sort by: a radix sort
    makes a pass per key byte (int64's 8 for the expert ids' 1)."""
    if n <= 256:
        return ids.to(torch.uint8)
    if n <= 32768:
        return ids.to(torch.int16)
    return ids


def _rows(x: torch.Tensor, row: torch.Tensor, dropping: bool) -> torch.Tensor:
    """x[row]; when dropping, row x.shape[0] (one past the end) reads zeros."""
    if dropping:
        x = torch.cat([x, x.new_zeros(1, x.shape[-1])])
    return x[row]


def sum_choices(rows: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """rows (k, N, C) -> their sum over the k choices, weighted by weights (N, k) if given,
    accumulated in fp32 and returned in rows' dtype, as k - 1 adds of whole (N, C) slices.
    Written as `.sum(0)`, inductor makes a reduction over a dim of k whose loads each touch k
    rows; on an H200 those kernels ran at about a fifth of the memory bandwidth
    (docs/benchmarks.md, MoE at micro batch 8 x 4). The adds fuse into one pointwise kernel,
    each of whose loads reads along a row."""
    total = None
    for j in range(rows.shape[0]):
        part = rows[j].float()
        if weights is not None:
            part = part * weights[:, j : j + 1]
        total = part if total is None else total + part
    return total.to(rows.dtype)


# Both directions of the dispatch and of the combine are gathers: the scatter-adds autograd
# would make of an index (atomics on GPUs, k of them into each token's row, summed in bf16 in
# no fixed order) become gathers and a sum over the k choices (fp32 accumulation, one order).
class _Dispatch(torch.autograd.Function):
    """tokens (N, C) -> rows `token` (M, C); backward sums each token's k copies, found by
    `row` (each assignment's row, choice-major)."""

    @staticmethod
    def forward(ctx, tokens, token, row, dropping):
        ctx.save_for_backward(row)
        n = tokens.shape[0]
        # k: copies per token; stated, since a view of no tokens cannot infer it.
        ctx.dropping, ctx.n, ctx.k = dropping, n, row.numel() // n if n else 1
        return tokens[token]

    @staticmethod
    def backward(ctx, grad):
        (row,) = ctx.saved_tensors
        copies = _rows(grad, row, ctx.dropping).view(ctx.k, ctx.n, grad.shape[-1])  # (k, N, C)
        return sum_choices(copies), None, None, None


class _Combine(torch.autograd.Function):
    """Expert outputs (M, C) in expert order -> one row per assignment (k N, C), choice-major,
    zeros for dropped ones; backward takes each output's row back by `order`."""

    @staticmethod
    def forward(ctx, out, order, row, dropping):
        ctx.save_for_backward(order)
        return _rows(out, row, dropping)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad[order], None, None, None


class MoE(nn.Module):
    """x -> shared_experts(x) + sum over the top-k experts e of weight_e * expert_e(x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        ffn = cfg.moe_ffn_hidden_size or cfg.shape.ffn_size
        self.num_experts, self.top_k = cfg.moe_num_experts, cfg.moe_top_k
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg, ffn)
        shared = cfg.moe_num_shared_experts
        self.shared_experts = MLP(cfg, ffn * shared) if shared else None
        gated = shared and cfg.moe_shared_expert_gate
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if gated else None
        self.loss_coeff, self.z_loss_coeff = cfg.moe_loss_coeff, cfg.moe_z_loss_coeff
        dropping = cfg.moe_token_dropping
        self.capacity_factors = (
            (cfg.moe_train_capacity_factor, cfg.moe_eval_capacity_factor) if dropping else None
        )
        self.min_capacity = cfg.moe_min_capacity
        self.stats: Optional[RouterStats] = None
        # Expert parallelism (neox/parallel/expert.py) puts its all-to-all dispatch here:
        # dispatch(experts, tokens (N, C), expert ids (N, k), weights (N, k), keep (N, k) or
        # None) -> sum over each token's kept choices of weight x expert output (N, C).
        self.dispatch: Optional[Callable[..., torch.Tensor]] = None

    def capacity(self, tokens: int) -> Optional[int]:
        """Assignments an expert takes (None: dropless)."""
        if self.capacity_factors is None:
            return None
        factor = self.capacity_factors[0 if self.training else 1]
        cap = math.ceil(factor * tokens * self.top_k / self.num_experts)
        return max(cap, self.min_capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); the router's losses and load are left in self.stats."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, C)
        weights, experts, scores, logits = self.router(tokens)  # (N, k) each
        # Choice-major order (all first choices, then all second ones), stable by token, so
        # capacity drops later choices and later tokens first (DeepSpeed-MoE's order).
        flat = experts.t().reshape(-1)  # (k N,)
        # A count of fixed shape (E,): bincount's output shape depends on the data, which
        # breaks a compiled block's graph at every MoE layer.
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # (E,)
        y, kept = self._route(tokens, weights, experts, flat, counts)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            y = y + shared
        self.stats = self._stats(scores, logits, counts, kept)
        return y.view(shape)

    def _route(
        self,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        flat: torch.Tensor,
        counts: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum over each token's choices of weight x expert output (N, C), and the
        assignments each expert kept (E,)."""
        n, e = tokens.shape[0], self.num_experts
        cap = self.capacity(n)
        if self.dispatch is not None and cap is None:  # dropless: no expert order needed here
            return self.dispatch(self.experts, tokens, experts, weights, None), counts
        order = torch.argsort(narrow_ids(flat, e), stable=True)
        kept = counts
        m = order.numel()  # k N
        position = torch.arange(m, device=tokens.device)
        if cap is not None:
            slot = position - (counts.cumsum(0) - counts)[flat[order]]  # within its expert
            # The assignments within capacity first (by expert, as before), the dropped ones
            # after them, outside every expert's rows: a fixed shape, where keeping only the
            # first would make the graph's shapes depend on the data.
            order = order[torch.argsort((slot >= cap).to(torch.uint8), stable=True)]
            kept = counts.clamp(max=cap)
            position = torch.where(position < kept.sum(), position, m)  # m: dropped
        dropping = cap is not None
        # Each assignment's row in expert order (k N,): order's inverse, m where dropped.
        row = torch.empty_like(flat).scatter_(0, order, position)
        if self.dispatch is not None:
            keep = (row < m).view(self.top_k, n).t()  # (N, k)
            return self.dispatch(self.experts, tokens, experts, weights, keep), kept
        routed = _Dispatch.apply(tokens, order % n, row, dropping)  # (k N, C), by expert
        out = self.experts(routed, kept)
        combined = _Combine.apply(out, order, row, dropping).view(self.top_k, n, -1)  # (k, N, C)
        return sum_choices(combined, weights), kept

    def _stats(
        self, scores: torch.Tensor, logits: torch.Tensor, counts: torch.Tensor, kept: torch.Tensor
    ) -> RouterStats:
        total = counts.sum()
        load = counts.float() / total  # f_e
        probs = scores / scores.sum(dim=-1, keepdim=True)  # sigmoid scores as a distribution
        balance = self.num_experts * (load * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        dropped = 1.0 - kept.sum().float() / total
        aux = self.loss_coeff * balance + self.z_loss_coeff * z
        return RouterStats(balance, z, load.detach(), dropped.detach(), aux)

    def aux_loss(self) -> torch.Tensor:
        """This layer's weighted auxiliary loss from its last forward."""
        assert self.stats is not None, "aux_loss before forward"
        return self.stats.aux


def moe_aux_loss(layers: Iterable[nn.Module]) -> torch.Tensor:
    """The weighted auxiliary losses of the MoE layers among `layers`, summed."""
    losses = [b.mlp.aux_loss() for b in layers if isinstance(getattr(b, "mlp", None), MoE)]
    return torch.stack(losses).sum()


def router_metrics(model: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """Each MoE layer's last forward, as metric names and detached scalars: moe/{layer}/
    balance_loss, z_loss, dropped (fraction of assignments past capacity) and load/{expert}
    (fraction of assignments to that expert; 1 / E each when balanced)."""
    names, values = [], []
    for name, module in model.named_modules():
        if not isinstance(module, MoE) or module.stats is None:
            continue
        layer = name.split(".")[-2] if name.endswith(".mlp") else name
        s = module.stats
        for metric in ("balance_loss", "z_loss", "dropped"):
            names.append(f"moe/{layer}/{metric}")
            values.append(getattr(s, metric).detach().float())
        names += [f"moe/{layer}/load/{e}" for e in range(s.load.numel())]
        values += list(s.load.float().unbind())
    return names, values
