"""Numeric precision: fp32, fp16 with dynamic loss scaling, or bf16 (DeepSpeed sections)."""

from typing import Annotated, Any, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator

from neox.config.base import MAX_COUNT, ConfigGroup, Reads, check_finite
from neox.config.errors import ConfigError


class PrecisionConfig(ConfigGroup):
    """DeepSpeed's fp16/bf16 sections, passed through, and gpt-neox's precision keys."""

    fp16: Annotated[
        Optional[dict[str, Any]], Reads("neox/config/derived.py", "neox/config/ds_config.py")
    ] = None
    """DeepSpeed fp16 section, e.g. {"enabled": true, "loss_scale": 0, "initial_scale_power": 12}."""

    bf16: Annotated[
        Optional[dict[str, Any]], Reads("neox/config/derived.py", "neox/config/ds_config.py")
    ] = None
    """DeepSpeed bf16 section, e.g. {"enabled": true}."""

    precision: Annotated[
        Optional[Literal["fp16", "fp32", "bfloat16", "bf16"]], Reads("neox/config/derived.py")
    ] = None
    """gpt-neox's precision key; derived from fp16/bf16 when unset."""

    amp: Annotated[Optional[dict[str, Any]], Reads("neox/config/ds_config.py")] = None
    """DeepSpeed amp section (passed through)."""

    fp32_allreduce: Annotated[bool, Reads("neox/config/ds_config.py")] = False
    """All-reduce gradients in fp32."""

    communication_data_type: Annotated[Optional[str], Reads("neox/config/ds_config.py")] = None
    """DeepSpeed communication data type (passed through)."""

    dynamic_loss_scale: Annotated[Optional[bool], Reads("neox/config/ds_config.py")] = None
    """fp16 only: true sets fp16.loss_scale 0 (dynamic scaling); false needs a static loss_scale."""

    loss_scale: Annotated[Optional[float], Reads("neox/config/ds_config.py")] = Field(
        None, ge=0, le=2.0**64
    )
    """fp16 static loss scale (0: dynamic); fp16.loss_scale wins when both are set."""

    loss_scale_window: Annotated[float, Reads("neox/config/ds_config.py")] = Field(
        1000.0, ge=1, le=MAX_COUNT
    )
    """gpt-neox key: iterations between loss-scale raises (fp16.loss_scale_window wins)."""

    hysteresis: Annotated[int, Reads("neox/config/ds_config.py")] = Field(2, ge=1, le=MAX_COUNT)
    """gpt-neox key: overflow tolerance before lowering the scale (fp16.hysteresis wins)."""

    min_scale: Annotated[float, Reads("neox/config/ds_config.py")] = Field(1.0, gt=0, le=2.0**64)
    """gpt-neox key: lowest loss scale (fp16.min_loss_scale wins)."""

    @field_validator("fp16", "bf16", "amp")
    @classmethod
    def _section_finite(cls, v: Any, info: ValidationInfo) -> Any:
        check_finite(v, info.field_name)
        return v

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

    def check_run(self, precision: str) -> None:
        """fp16's dynamic_loss_scale against a static loss scale (gpt-neox's two spellings);
        run by `derive`, which knows the precision."""
        static = self.loss_scale or (self.fp16 or {}).get("loss_scale")
        if precision != "fp16":
            return
        if self.dynamic_loss_scale and static:
            raise ConfigError(
                f"dynamic_loss_scale=true contradicts a static loss_scale={static}; drop one of them"
            )
        if self.dynamic_loss_scale is False and not static:
            raise ConfigError(
                "dynamic_loss_scale=false needs a static loss scale; set loss_scale (e.g. 1024) "
                "or drop dynamic_loss_scale"
            )
