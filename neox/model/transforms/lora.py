"""LoRA applied from outside the plain GPTNeoX: low-rank adapters on named linears, base frozen.

Each target linear W (out, in) gets children `lora_A` (r, in) and `lora_B` (out, r) and computes
    y = W x + (alpha / r) * B A dropout(x),
with A drawn like PEFT's (Kaiming-uniform) and B = 0, so training starts from the base model.
Module and parameter names stay those of the plain model (`...query_key_value.weight`), and the
adapters sit beside them as `...query_key_value.lora_A.weight`, PEFT's own names.

Applied after tensor parallelism, each adapter is split so that no rank holds more than its
share and the output equals the tp=1 one:
- column-parallel W (output rows split, input replicated): A is replicated and B split by rows
  like W, i.e. B is itself column-parallel. The copy on B's input sums dL/d(Ax) over ranks in
  the backward, so A's gradient is the full one on every rank.
- row-parallel W (input columns split, x arrives split): A split by columns like W, i.e. A is
  row-parallel (its partial products are all-reduced into the full r-vector), B replicated.
  Where W returns this rank's share of its output for the block to all-reduce (a parallel-residual
  block under tensor parallelism: RowParallelLinear.parallel_output), the adapter's output, whole
  on every rank, joins it as a share too (replicated_share), so the block's sum is still right.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from neox.config.lora import LoraConfig
from neox.model.init import parameter_seed
from neox.parallel.layers import ColumnParallelLinear, RowParallelLinear, replicated_share, shard
from neox.parallel.tensor import _plan_kind

# neox module name (lora_target_modules, after aliases) -> its path inside a block.
LORA_TARGETS: dict[str, str] = {
    "query_key_value": "attention.query_key_value",
    "dense": "attention.dense",
    "dense_h_to_4h": "mlp.dense_h_to_4h",
    "gate": "mlp.gate",
    "dense_4h_to_h": "mlp.dense_4h_to_h",
}

# How tensor parallelism splits an adapter, by its base's split: (A's dim, B's dim), None for
# replicated; the dims are those of ColumnParallelLinear/RowParallelLinear's PARTITION_DIMS.
ADAPTER_SPLIT: dict[str, tuple[Optional[int], Optional[int]]] = {
    "column": (None, 0),
    "row": (1, None),
}


def target_modules(model: nn.Module, targets: list[str]) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every linear that `targets` (neox names) selects, in model order."""
    suffixes = tuple("." + LORA_TARGETS[t] for t in targets)
    for name, module in model.named_modules():
        if name.endswith(suffixes) and hasattr(module, "weight"):
            yield name, module


def lora_partition_dim(name: str) -> Optional[int]:
    """The dim tensor parallelism splits adapter parameter `name` along, or None (replicated;
    also for names that are no adapter's)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-2] not in ("lora_A", "lora_B"):
        return None
    kind = _plan_kind(".".join(parts[:-2]))
    if kind not in ADAPTER_SPLIT:
        return None
    return ADAPTER_SPLIT[kind][parts[-2] == "lora_B"]


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def init_lora_A(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """The full (r, in) initial A of the adapter on linear `name`, a function of (name, seed)
    alone (so every layout starts from the same numbers): PEFT's Kaiming-uniform, a=sqrt(5)."""
    g = torch.Generator().manual_seed(parameter_seed(name + ".lora_A.weight", seed))
    return nn.init.kaiming_uniform_(torch.empty(rank, in_features), a=math.sqrt(5), generator=g)


def _adapter_pair(
    base: nn.Module, kind: Optional[str], rank: int, group: Any
) -> tuple[nn.Module, nn.Module]:
    """(A, B) linears for `base`, laid out for its tensor-parallel split (module docstring)."""
    w = base.weight
    make = dict(bias=False, device=w.device, dtype=torch.float32)
    if kind == "column":
        a = nn.Linear(base.in_features, rank, **make)
        return a, ColumnParallelLinear(rank, base.out_features, group, **make)
    if kind == "row":
        a = RowParallelLinear(base.in_features, rank, group, input_is_parallel=True, **make)
        return a, nn.Linear(rank, base.out_features, **make)
    return nn.Linear(base.in_features, rank, **make), nn.Linear(rank, base.out_features, **make)


class LoRAForward:
    """Mixed into a target linear's class: its output plus its adapter's. A base held in
    another dtype than the activations (lora_base_dtype) reads them cast to its own and returns
    them cast back. A class rather than a per-module forward, so that torch.compile sees one
    function for every layer and compiles the block once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        y = super().forward(x if x.dtype == w.dtype else x.to(w.dtype))
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        delta = self.lora_B(self.lora_A(self.lora_dropout(x))) * self.lora_scale
        if getattr(self, "parallel_output", False):
            delta = replicated_share(delta, self.world)
        return y + delta


_LORA_CLASSES: dict[type, type] = {}


def _with_lora(cls: type) -> type:
    """`cls` with LoRAForward mixed in, one class per base class (nn.Linear, the tp layers)."""
    if cls not in _LORA_CLASSES:
        _LORA_CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRAForward, cls), {})
    return _LORA_CLASSES[cls]


@torch.no_grad()
def apply_lora(
    model: nn.Module, cfg: LoraConfig, groups: Any = None, seed: int = 1234
) -> list[str]:
    """Freeze every parameter of `model` and add adapters to the target linears, in place.

    `model` is a plain or tensor-parallel GPTNeoX (apply_tensor_parallel first: the adapters
    follow their base's split); returns the names of the adapted linears.
    """
    tp = 1 if groups is None else groups.get_tensor_model_parallel_world_size()
    group = None if groups is None else groups.tensor
    rank = 0 if groups is None else groups.get_tensor_model_parallel_rank()
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for name, module in list(target_modules(model, cfg.lora_target_modules)):
        kind = _plan_kind(name) if tp > 1 else None
        a, b = _adapter_pair(module, kind, cfg.lora_rank, group)
        full_a = init_lora_A(name, cfg.lora_rank, module.in_features, seed)
        a.weight.copy_(full_a if kind != "row" else shard(full_a, 1, rank, tp))
        b.weight.zero_()
        module.lora_A, module.lora_B = a, b
        module.lora_dropout = nn.Dropout(cfg.lora_dropout)
        module.lora_scale = cfg.lora_alpha / cfg.lora_rank
        module.__class__ = _with_lora(type(module))
        names.append(name)
    if not names:
        raise ValueError(
            f"lora_target_modules={cfg.lora_target_modules} match no linear of the model"
        )
    return names


@torch.no_grad()
def cast_lora_base(model: nn.Module, cfg: LoraConfig) -> None:
    """Hold the frozen weights of the adapted linears in lora_base_dtype (after the engine has
    cast the model to the training precision); the adapters keep theirs."""
    if cfg.lora_base_dtype is None:
        return
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        cfg.lora_base_dtype
    ]
    for _, module in target_modules(model, cfg.lora_target_modules):
        for p in (module.weight, module.bias):
            if p is not None and not p.requires_grad:
                p.data = p.data.to(dtype)


def merge_lora(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], cfg: LoraConfig
) -> dict[str, torch.Tensor]:
    """The full plain state dict with every adapter folded in: W + (alpha / r) B A, computed in
    fp32 and stored in W's dtype. `adapters` holds full (tp-merged) lora_A/lora_B weights."""
    out = dict(base)
    scale = cfg.lora_alpha / cfg.lora_rank
    linears = sorted({k.rsplit(".lora_A.", 1)[0] for k in adapters if ".lora_A." in k})
    for linear in linears:
        a = adapters[f"{linear}.lora_A.weight"].float()
        b = adapters[f"{linear}.lora_B.weight"].float()
        w = base[f"{linear}.weight"]
        out[f"{linear}.weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return out
