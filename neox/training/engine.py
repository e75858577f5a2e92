"""The engine a run steps with: neox's flat engine for data parallelism alone, else DeepSpeed's with its per-tensor
overflow check made one launch.

DeepSpeed's ZeRO 1/2 optimizer checks for non-finite gradients before every step, tensor by
tensor (amax, amin, two isfinite, two logical ops, an add: ~7 kernels and their host work per
parameter tensor). On one H100 at Pythia-410M that host work costs ~50 ms a step, more than a
third of the step. `fuse_overflow_check` replaces it, on that one optimizer instance, by the
same test written with one foreach max-abs per dtype: a step with any inf/NaN gradient is still
skipped exactly as before; only the number of launches changes.
"""

from __future__ import annotations

import logging
import types
from collections import defaultdict
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def build_engine(
    ds_config: dict[str, Any],
    model: nn.Module,
    optimizer: Any,
    mpu: Any,
    flat_engine: bool = True,
) -> Any:
    """neox's flat engine where it applies (neox.training.flat_engine), else deepspeed.initialize
    with neox's DeepSpeed config and the fast overflow check."""
    import deepspeed

    from neox.training.flat_engine import FlatEngine, unsupported_reason

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    dp = mpu.get_data_parallel_world_size() if mpu is not None else 1
    reason = unsupported_reason(ds_config, optimizer, dp, world // dp)
    if flat_engine and reason is None:
        log.info("neox's flat engine (flat_engine: false for DeepSpeed's)")
        return FlatEngine(ds_config, model, optimizer, mpu)
    if flat_engine:
        log.info("DeepSpeed's engine: the flat engine does not cover %s", reason)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, mpu=mpu
    )
    fuse_overflow_check(engine.optimizer)
    return engine


def skipped_count(engine: Any) -> Any:
    """The engine's count of skipped steps, read without waiting for the device: the flat
    engine keeps it on the device (a copy, as the engine adds to its own)."""
    from neox.training.flat_engine import FlatEngine

    if isinstance(engine, FlatEngine):
        return engine.skipped_steps_tensor.clone()
    return engine.skipped_steps


def handles_nonfinite(engine: Any) -> bool:
    """Does the engine skip steps with inf/NaN gradients and report the gradient norm itself?
    DeepSpeed's does only with ZeRO or a reduced precision."""
    from neox.training.flat_engine import FlatEngine

    return isinstance(engine, FlatEngine) or engine.zero_optimization_stage() > 0


def fuse_overflow_check(optimizer: Any) -> bool:
    """Swap a ZeRO 1/2 optimizer's serial overflow check for the foreach one; True if swapped."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload:
        return False
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(
        _has_overflow_partitioned_grads, optimizer
    )
    return True


def any_non_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Bool tensor of shape (1,): does any tensor hold an inf or NaN? No host sync."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_dtype[t.dtype].append(t)
    # max |x| of a tensor is inf when it holds an inf and NaN when it holds a NaN.
    bad = [
        ~torch.isfinite(torch.stack(torch._foreach_norm(ts, float("inf")))).all()
        for ts in by_dtype.values()
    ]
    if not bad:
        return torch.zeros(1, dtype=torch.bool)
    return torch.stack(bad).any().reshape(1)


def _has_overflow_partitioned_grads(self: Any) -> torch.Tensor:
    """DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial, in a few launches."""
    from deepspeed.accelerator import get_accelerator

    groups = (self.averaged_gradients[i] for i in range(len(self.bit16_groups)))
    grads = [g for group in groups for g in group if g is not None]
    if not grads:
        return torch.zeros(1, dtype=torch.bool, device=get_accelerator().current_device_name())
    return any_non_finite(grads)
