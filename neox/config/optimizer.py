"""Optimizer and learning-rate schedule."""

import math
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from neox.config.base import MAX_COUNT, MAX_LR, ConfigGroup, Reads, Refused
from neox.config.errors import ConfigError

OPTIMIZER_TYPES = ("adam", "adamw", "cpu_adam", "cpu_torch_adam", "sgd", "lion")
# The keyword arguments of the class neox/training/optim.py builds for each type (torch's AdamW
# and SGD, DeepSpeed's CPU Adam and FusedLion; tests/config/test_bad_values.py holds this to
# their signatures), less SET_BY_NEOX, which neox chooses itself (AdamW's fused kernel on GPU).
SET_BY_NEOX = {"fused"}
_ADAMW = {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable"}
_CPU_ADAM = {"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "adamw_mode"}
OPTIMIZER_PARAMS = {
    "adam": _ADAMW | {"differentiable"},
    "adamw": _ADAMW | {"differentiable"},
    "cpu_adam": _CPU_ADAM | {"fp32_optimizer_states"},
    "cpu_torch_adam": _CPU_ADAM | {"fp32_optimizer_states"},
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach"}
    | {"differentiable"},
    "lion": {"lr", "betas", "weight_decay", "set_grad_none"},
}


def unknown_params(kind: str, params: dict[str, Any], shown: str) -> Optional[str]:
    """Why `params` cannot be passed to optimizer `kind` (shown as `shown`), or None: a name its
    class does not take would be a TypeError on every rank."""
    extra = sorted(set(params) - OPTIMIZER_PARAMS[kind])
    if not extra:
        return None
    return (
        f"optimizer.params.{extra[0]} is not a parameter of {shown}; it takes "
        f"{', '.join(sorted(OPTIMIZER_PARAMS[kind]))}"
    )


class OptimizerSpec(ConfigGroup):
    """gpt-neox's `optimizer` section: {"type": "Adam", "params": {"lr": ..., "betas": [...]}}."""

    type: str = "Adam"
    """Adam/AdamW (fused on GPU), CPU_Adam, SGD, Lion (case-insensitive)."""

    params: dict[str, Any] = {"lr": 6.0e-4, "betas": [0.9, 0.95], "eps": 1.0e-8}
    """Keyword arguments of the optimizer; `lr` is the peak learning rate. Adam's `betas`, when
    a section's params leave them out, are torch's (0.9, 0.999), as in gpt-neox."""

    @model_validator(mode="before")
    @classmethod
    def _type_and_params(cls, data: Any) -> Any:
        # As gpt-neox: a section without `type` would silently train with Adam.
        if isinstance(data, dict):
            missing = [k for k in ("type", "params") if k not in data]
            if missing:
                raise ValueError(
                    f"the optimizer section lacks {' and '.join(missing)}; write it as "
                    '{"type": "Adam", "params": {"lr": ...}} (or use optimizer_type and lr)'
                )
        return data

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        if v.lower() not in OPTIMIZER_TYPES:
            raise ValueError(f"optimizer type {v!r} is not available; use one of {OPTIMIZER_TYPES}")
        return v

    @field_validator("params")
    @classmethod
    def _numbers(cls, v: dict[str, Any]) -> dict[str, Any]:
        # The section is the optimizer's keyword arguments: check the numbers every optimizer
        # shares here, so a NaN or a sign slip fails before launch rather than on every rank.
        for name, value in v.items():
            numbers = value if isinstance(value, (list, tuple)) else [value]
            for x in numbers:
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    if name in ("lr", "betas", "eps", "weight_decay", "momentum"):
                        raise ValueError(f"optimizer.params.{name}={value!r} must be numbers")
                elif not math.isfinite(x):
                    raise ValueError(f"optimizer.params.{name}={value!r} must be finite")
        lr = v.get("lr", 0)
        if lr < 0:
            raise ValueError(f"optimizer.params.lr={lr} is negative; learning rates are >= 0")
        if lr > MAX_LR:
            raise ValueError(
                f"optimizer.params.lr={lr} exceeds {MAX_LR:g}; the first update would overflow"
            )
        betas = v.get("betas", [0.9, 0.999])
        if not (
            isinstance(betas, (list, tuple)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)
        ):
            raise ValueError(f"optimizer.params.betas={betas!r} must be two numbers in [0, 1)")
        momentum = v.get("momentum", 0)
        if (
            isinstance(momentum, bool)
            or not isinstance(momentum, (int, float))
            or not (0 <= momentum < 1)
        ):
            raise ValueError(
                f"optimizer.params.momentum={momentum!r} must be in [0, 1) (0.9 is usual): at 1 "
                "or above the step grows without bound"
            )
        if v.get("eps", 1) <= 0 or v.get("weight_decay", 0) < 0:
            raise ValueError(
                f"optimizer.params eps={v.get('eps')} must be > 0 and weight_decay="
                f"{v.get('weight_decay')} >= 0"
            )
        return v

    @model_validator(mode="after")
    def _params_of_type(self) -> "OptimizerSpec":
        if (problem := unknown_params(self.type.lower(), self.params, self.type)) is not None:
            raise ValueError(problem)
        return self

    @property
    def lr(self) -> float:
        return float(self.params.get("lr", 6.0e-4))


class OptimizerConfig(ConfigGroup):
    """What updates the weights, and how the learning rate moves."""

    optimizer: Annotated[
        OptimizerSpec, Reads("neox/config/derived.py", "neox/training/setup.py")
    ] = OptimizerSpec.model_construct()
    """Optimizer type and parameters (gpt-neox layout). Adam's betas, where params leave them
    out, are torch's (0.9, 0.999), as in gpt-neox."""

    weight_decay: Annotated[float, Reads("neox/training/optim.py")] = Field(0.01, ge=0, le=1)
    """Decoupled weight decay; biases and norm weights are exempt."""

    lr_decay_style: Annotated[
        Literal["constant", "linear", "cosine", "exponential"], Reads("neox/training/setup.py")
    ] = "linear"
    """Shape of the decay after warmup."""

    lr_decay_iters: Annotated[Optional[int], Reads("neox/config/derived.py")] = Field(
        None, ge=1, le=MAX_COUNT
    )
    """Iterations over which the learning rate decays (None: train_iters)."""

    lr_decay_fraction: Annotated[Optional[float], Reads("neox/config/derived.py")] = Field(
        None, gt=0, le=1
    )
    """Decay over this fraction of train_iters instead of lr_decay_iters."""

    min_lr: Annotated[float, Reads("neox/training/setup.py")] = Field(0.0, ge=0, le=MAX_LR)
    """Floor of the decayed learning rate."""

    warmup: Annotated[float, Reads("neox/config/derived.py")] = Field(0.01, ge=0, le=1)
    """Warmup length as a fraction of the decay iterations."""

    override_lr_scheduler: bool = False
    """No-op (gpt-neox key): neox always computes the schedule from the config and the
    iteration, which is what override_lr_scheduler asks for."""

    use_checkpoint_lr_scheduler: Annotated[
        bool,
        Refused(
            feature="use_checkpoint_lr_scheduler is not implemented",
            example=True,
            allowed=(False,),
            message=(
                "use_checkpoint_lr_scheduler is not implemented: neox computes the schedule from "
                "the config and the iteration; set the schedule keys to the checkpoint's"
            ),
        ),
    ] = False
    """gpt-neox key (take the schedule from the checkpoint): not implemented, must be false."""

    optimizer_type: Annotated[Optional[str], Reads("neox/config/derived.py")] = None
    """gpt-neox's flat spelling of optimizer.type; used when no `optimizer` section is given, and
    an error when it contradicts one."""

    lr: Annotated[Optional[float], Reads("neox/config/derived.py")] = Field(None, ge=0, le=MAX_LR)
    """gpt-neox's top-level peak learning rate; overrides optimizer.params.lr."""

    @field_validator("min_lr", "lr")
    @classmethod
    def _lr_not_negative(cls, v: Optional[float], info) -> Optional[float]:
        if v is not None and v < 0:
            raise ValueError(f"{info.field_name}={v} is negative; learning rates are >= 0")
        return v

    def check_run(self, lr: float) -> None:
        """Combinations gpt-neox's own validation refuses (NeoXArgs.validate_values), against
        the peak learning rate `derive` resolves."""
        if self.min_lr > lr:
            raise ConfigError(
                f"min_lr={self.min_lr} exceeds the peak learning rate {lr}; lower min_lr or raise "
                "lr"
            )
