"""Numeric precision: fp32, fp16 with dynamic loss scaling, or bf16 (DeepSpeed sections)."""

from typing import Any, Literal, Optional

from pydantic import ValidationInfo, field_validator

from neox.config.base import ConfigGroup


class PrecisionConfig(ConfigGroup):
    """DeepSpeed's fp16/bf16 sections, passed through, and gpt-neox's precision keys."""

    fp16: Optional[dict[str, Any]] = None
    """DeepSpeed fp16 section, e.g. {"enabled": true, "loss_scale": 0, "initial_scale_power": 12}."""

    bf16: Optional[dict[str, Any]] = None
    """DeepSpeed bf16 section, e.g. {"enabled": true}."""

    precision: Optional[Literal["fp16", "fp32", "bfloat16", "bf16"]] = None
    """gpt-neox's precision key; derived from fp16/bf16 when unset."""

    amp: Optional[dict[str, Any]] = None
    """DeepSpeed amp section (passed through)."""

    fp32_allreduce: bool = False
    """All-reduce gradients in fp32."""

    communication_data_type: Optional[str] = None
    """DeepSpeed communication data type (passed through)."""

    dynamic_loss_scale: Optional[bool] = None
    """fp16 only: true sets fp16.loss_scale 0 (dynamic scaling); false needs a static loss_scale."""

    loss_scale: Optional[float] = None
    """fp16 static loss scale (0: dynamic); fp16.loss_scale wins when both are set."""

    loss_scale_window: float = 1000.0
    """gpt-neox key: iterations between loss-scale raises (fp16.loss_scale_window wins)."""

    hysteresis: int = 2
    """gpt-neox key: overflow tolerance before lowering the scale (fp16.hysteresis wins)."""

    min_scale: float = 1.0
    """gpt-neox key: lowest loss scale (fp16.min_loss_scale wins)."""

    @field_validator("fp16", "amp")
    @classmethod
    def _says_enabled(
        cls, v: Optional[dict[str, Any]], info: ValidationInfo
    ) -> Optional[dict[str, Any]]:
        # gpt-neox refuses these sections without `enabled`; DeepSpeed would read them as off.
        if v is not None and "enabled" not in v:
            raise ValueError(
                f"the {info.field_name} section has no `enabled` key; add enabled: true (or "
                "false), as gpt-neox requires"
            )
        return v
