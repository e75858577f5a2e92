"""FP8 training applied from outside the model: the chosen block linears compute in float8
through torchao (dynamic scaling from each tensor's current amax), weights stay in bf16/fp32.

`apply_float8(model, spec, num_layers, device)` swaps the plain model's nn.Linear for torchao's
Float8Linear (convert_to_float8_training with a module filter); tensor-parallel linears
(neox/parallel/layers.py) keep their class and collectives and get a float8 matmul in place of
F.linear, as the output layer does with fp8.output_layer (GPTNeoX.head_linear). Parameter
names, shapes and dtypes are unchanged, so checkpoints and the HF export are the same as a
bf16 run's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from neox.config.float8 import Float8Spec
from neox.parallel.layers import ColumnParallelLinear, RowParallelLinear

log = logging.getLogger(__name__)

# torch._scaled_mm needs both matrix dimensions of the weight divisible by 16.
FP8_DIM_MULTIPLE = 16
# The first GPUs with float8 tensor cores: Ada (sm89) and Hopper (sm90).
FP8_CAPABILITY = (8, 9)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def fp8_device_problem(device: Any) -> Optional[str]:
    """Why `device` cannot run float8 matmuls, or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"fp8.enabled needs a GPU with float8 tensor cores; these ranks run on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"fp8.enabled needs compute capability 8.9 or newer (H100, H200, L40S, RTX 4090); "
            f"{name} is {major}.{minor}"
        )
    return None


def torchao_config(spec: Float8Spec, emulate: bool = False) -> Any:
    """torchao's Float8LinearConfig for `spec` (a resolved section: format and wgrad set)."""
    from torchao.float8.config import (
        CastConfig,
        Float8GemmConfig,
        Float8LinearConfig,
        ScalingType,
        e4m3_dtype,
        e5m2_dtype,
    )

    base = Float8LinearConfig.from_recipe_name(spec.recipe)
    fields = {
        "cast_config_input": base.cast_config_input,
        "cast_config_weight": base.cast_config_weight,
        "cast_config_grad_output": base.cast_config_grad_output,
        "round_scales_to_power_of_2": base.round_scales_to_power_of_2,
    }
    if spec.format is not None:
        grad = base.cast_config_grad_output
        target = e5m2_dtype if spec.format == "hybrid" else e4m3_dtype
        fields["cast_config_grad_output"] = CastConfig(
            scaling_type=grad.scaling_type,
            scaling_granularity=grad.scaling_granularity,
            target_dtype=target,
        )
    if spec.wgrad is False:
        # grad_weight = input^T @ grad_output in high precision (Transformer Engine's
        # override_linear_precision for wgrad); both operands must then skip the cast.
        for name in ("input", "grad_output"):
            cast = fields[f"cast_config_{name}"]
            fields[f"cast_config_{name}_for_grad_weight"] = CastConfig(
                scaling_type=ScalingType.DISABLED, target_dtype=cast.target_dtype
            )
    if spec.fast_accum_backward:
        # torchao accumulates only the forward matmul in the fast mode by default.
        fields["gemm_config_grad_input"] = Float8GemmConfig(use_fast_accum=True)
        fields["gemm_config_grad_weight"] = Float8GemmConfig(use_fast_accum=True)
    return Float8LinearConfig(**fields, emulate=emulate)


def module_filter(spec: Float8Spec, num_layers: int) -> Callable[[nn.Module, str], bool]:
    """Whether the linear at `fqn` runs in float8: one of spec.modules in a block outside the
    first skip_first_layers and last skip_last_layers, with dimensions _scaled_mm accepts."""
    last = num_layers - spec.skip_last_layers

    def keep(module: nn.Module, fqn: str) -> bool:
        match = _LAYER.search(fqn)
        if match is None or match.group(2) not in spec.modules:
            return False
        if not spec.skip_first_layers <= int(match.group(1)) < last:
            return False
        out_features, in_features = module.weight.shape
        return in_features % FP8_DIM_MULTIPLE == 0 and out_features % FP8_DIM_MULTIPLE == 0

    return keep


class Float8Matmul:
    """F.linear(x, weight, bias) with x @ weight^T in float8: torchao's autograd function, for
    the tensor-parallel linears, which keep their own collectives around it."""

    def __init__(self, config: Any) -> None:
        from torchao.float8.float8_linear import Float8Linear

        self.config = config
        with torch.device("meta"):  # torchao derives the per-gemm settings from its config
            self.mm_config = Float8Linear(16, 16, bias=False, config=config).linear_mm_config

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        return y if bias is None else y + bias.to(y.dtype)


def apply_float8(
    model: nn.Module,
    spec: Optional[Float8Spec],
    num_layers: int,
    device: Any,
    emulate: bool = False,
) -> list[str]:
    """Convert the linears `spec` selects to float8 compute, in place; the names converted
    ("head" for the output layer).

    Args:
        spec: the resolved fp8 section (Float8Config.resolved()); None does nothing.
        emulate: torchao's emulation (float8 rounding, matmuls in high precision) where there
            are no float8 tensor cores; for tests only, training refuses such devices.
    """
    if spec is None:
        return []
    if not emulate and (problem := fp8_device_problem(device)):
        raise RuntimeError(f"{problem}; set fp8: {{enabled: false}} or run on such GPUs")
    from torchao.float8 import convert_to_float8_training

    config = torchao_config(spec, emulate)
    keep = module_filter(spec, num_layers)
    converted: list[str] = []

    def chosen(module: nn.Module, fqn: str) -> bool:
        if keep(module, fqn):
            converted.append(fqn)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=chosen, config=config)
    matmul = None
    for fqn, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and chosen(module, fqn):
            matmul = matmul or Float8Matmul(config)
            module.linear = matmul
    if spec.output_layer and hasattr(model, "head_linear"):
        rows, cols = model.head_weight().shape  # (vocab or its tp shard, hidden)
        if rows % FP8_DIM_MULTIPLE == 0 and cols % FP8_DIM_MULTIPLE == 0:
            model.head_linear = matmul or Float8Matmul(config)
            converted.append("head")
    log.info(
        "fp8 (%s): %d linears in float8, first %d and last %d blocks and the embedding in "
        "high precision, the output layer in %s",
        spec.recipe,
        len(converted),
        spec.skip_first_layers,
        spec.skip_last_layers,
        "float8" if "head" in converted else "high precision",
    )
    return converted
