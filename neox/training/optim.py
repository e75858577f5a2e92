"""Optimizer construction: decay only matrices, pick the fastest Adam for the device."""

import logging
from typing import Any

import torch
from torch import nn

from neox.config.optimizer import OptimizerConfig

log = logging.getLogger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weights of linears/embeddings decay; biases and norm weights do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, kind: str, lr: float, adamw_mode: bool = True
) -> torch.optim.Optimizer:
    """The optimizer `kind` (EngineChoice.optimizer: the config's type, or cpu_adam under
    ZeRO-Offload) at peak learning rate `lr`; `adamw_mode` is cpu_adam's decoupled decay."""
    params = dict(cfg.optimizer.params, lr=lr)
    groups = param_groups(model, cfg.weight_decay)
    on_gpu = any(p.is_cuda for g in groups for p in g["params"])
    if kind in ("adam", "adamw"):
        # Params without betas get torch's (0.9, 0.999), as gpt-neox's Adam does.
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        params.pop("weight_decay", None)
        # fused=True runs one kernel for all parameters on GPU (as apex/DeepSpeed FusedAdam).
        return torch.optim.AdamW(groups, fused=on_gpu or None, **params)
    if kind in ("cpu_adam", "cpu_torch_adam"):
        # DeepSpeed's C++ Adam on CPU-resident fp32 states (JIT-built on first use).
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        params.pop("weight_decay", None)  # per group, as for AdamW
        params.setdefault("adamw_mode", adamw_mode)
        try:
            return DeepSpeedCPUAdam(groups, **params)
        except (RuntimeError, ImportError, OSError) as e:  # its C++ op failed to build or load
            raise RuntimeError(
                f"DeepSpeed's CPU Adam (optimizer {kind}, or zero_optimization.offload_optimizer) "
                f"cannot be built on this machine: {e}; install a C++ compiler and ninja, or "
                "drop offload_optimizer"
            ) from e
    if kind == "sgd":
        return torch.optim.SGD(groups, **params)
    if kind == "lion":
        from deepspeed.ops.lion import FusedLion

        return FusedLion(groups, **params)
    raise ValueError(f"optimizer type {kind!r} is not available")
