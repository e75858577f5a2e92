"""Optimizer and learning-rate schedule."""

from typing import Any, Literal, Optional

from pydantic import field_validator, model_validator

from neox.config.base import ConfigGroup, refuse_unless

OPTIMIZER_TYPES = ("adam", "adamw", "cpu_adam", "cpu_torch_adam", "sgd", "lion")


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
    def _lr_param(cls, v: dict[str, Any]) -> dict[str, Any]:
        if float(v.get("lr", 0)) < 0:
            raise ValueError(f"optimizer.params.lr={v['lr']} is negative; learning rates are >= 0")
        return v

    @property
    def lr(self) -> float:
        return float(self.params.get("lr", 6.0e-4))


class OptimizerConfig(ConfigGroup):
    """What updates the weights, and how the learning rate moves."""

    optimizer: OptimizerSpec = OptimizerSpec.model_construct()
    """Optimizer type and parameters (gpt-neox layout). Adam's betas, where params leave them
    out, are torch's (0.9, 0.999), as in gpt-neox."""

    weight_decay: float = 0.01
    """Decoupled weight decay; biases and norm weights are exempt."""

    lr_decay_style: Literal["constant", "linear", "cosine", "exponential"] = "linear"
    """Shape of the decay after warmup."""

    lr_decay_iters: Optional[int] = None
    """Iterations over which the learning rate decays (None: train_iters)."""

    lr_decay_fraction: Optional[float] = None
    """Decay over this fraction of train_iters instead of lr_decay_iters."""

    min_lr: float = 0.0
    """Floor of the decayed learning rate."""

    warmup: float = 0.01
    """Warmup length as a fraction of the decay iterations."""

    override_lr_scheduler: bool = False
    """No-op (gpt-neox key): neox always computes the schedule from the config and the
    iteration, which is what override_lr_scheduler asks for."""

    use_checkpoint_lr_scheduler: bool = False
    """gpt-neox key (take the schedule from the checkpoint): not implemented, must be false."""

    optimizer_type: Optional[str] = None
    """gpt-neox's flat spelling of optimizer.type; used when no `optimizer` section is given, and
    an error when it contradicts one."""

    lr: Optional[float] = None
    """gpt-neox's top-level peak learning rate; overrides optimizer.params.lr."""

    @field_validator("min_lr", "lr")
    @classmethod
    def _lr_not_negative(cls, v: Optional[float], info) -> Optional[float]:
        if v is not None and v < 0:
            raise ValueError(f"{info.field_name}={v} is negative; learning rates are >= 0")
        return v

    _no_checkpoint_schedule = refuse_unless(
        "use_checkpoint_lr_scheduler",
        allowed=(False,),
        message="use_checkpoint_lr_scheduler is not implemented: neox computes the schedule "
        "from the config and the iteration; set the schedule keys to the checkpoint's",
    )

    @field_validator("warmup")
    @classmethod
    def _warmup_fraction(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"warmup={v} is a fraction of the decay iterations; use 0..1")
        return v
