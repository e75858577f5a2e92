"""DeepSpeed sections neox does not interpret: passed into the DeepSpeed config as written."""

from typing import Annotated, Any, Optional

from pydantic import Field, ValidationInfo, field_validator

from neox.config.base import MAX_COUNT, MAX_RANKS, ConfigGroup, Reads, Refused, check_finite


class DeepSpeedConfig(ConfigGroup):
    """DeepSpeed's own config sections and gpt-neox's shorthands for them."""

    zero_optimization: Annotated[
        Optional[dict[str, Any]],
        Reads(
            "neox/config/ds_config.py", "neox/config/deepspeed.py", "neox/training/flat_engine.py"
        ),
    ] = None
    """DeepSpeed ZeRO section, e.g. {"stage": 1, "overlap_comm": true}. At stage 3, where unset
    and DeepCompile is off, neox's transformer blocks are ZeRO-3 leaf modules (`leaf_module: {classes:
    [neox.model.block.Block]}`): a block's weights are gathered at once, and its compiled graph
    is not broken by a hook per submodule. neox's flat engine (data parallelism alone) reads
    `overlap_comm` (default false) and `reduce_bucket_size` (default 500,000,000 elements): with
    overlap_comm, gradients are all-reduced in buckets of at most reduce_bucket_size elements
    during the backward of a step's last micro batch instead of reduce-scattered after it
    (neox/training/grad_buckets.py); not with fp32_allreduce or a communication_data_type other
    than the gradients' own, where they are reduced after the backward."""

    zero_stage: Annotated[Optional[int], Reads("neox/config/deepspeed.py")] = Field(
        None, ge=0, le=3
    )
    """gpt-neox shorthand for zero_optimization.stage."""

    zero_reduce_scatter: Annotated[Optional[bool], Reads("neox/config/ds_config.py")] = None
    """gpt-neox shorthand for zero_optimization.reduce_scatter."""

    zero_contiguous_gradients: Annotated[Optional[bool], Reads("neox/config/ds_config.py")] = None
    """gpt-neox shorthand for zero_optimization.contiguous_gradients."""

    zero_reduce_bucket_size: Annotated[Optional[int], Reads("neox/config/ds_config.py")] = Field(
        None, ge=1, le=MAX_COUNT
    )
    """gpt-neox shorthand for zero_optimization.reduce_bucket_size."""

    zero_allgather_bucket_size: Annotated[Optional[int], Reads("neox/config/ds_config.py")] = Field(
        None, ge=1, le=MAX_COUNT
    )
    """gpt-neox shorthand for zero_optimization.allgather_bucket_size."""

    activation_checkpointing: Annotated[
        Optional[dict[str, Any]], Reads("neox/config/ds_config.py")
    ] = None
    """DeepSpeed activation checkpointing section (derived from checkpoint_* keys when unset)."""

    flops_profiler: Annotated[Optional[dict[str, Any]], Reads("neox/config/ds_config.py")] = None
    """DeepSpeed flops profiler section."""

    comms_logger: Annotated[Optional[dict[str, Any]], Reads("neox/config/ds_config.py")] = None
    """DeepSpeed communication logger section."""

    autotuning: Annotated[Optional[dict[str, Any]], Reads("neox/config/ds_config.py")] = None
    """DeepSpeed autotuning section."""

    elasticity: Annotated[Optional[dict[str, Any]], Reads("neox/config/ds_config.py")] = None
    """DeepSpeed elasticity section."""

    csv_monitor: Annotated[Optional[dict[str, Any]], Reads("neox/config/ds_config.py")] = None
    """DeepSpeed CSV monitor section."""

    checkpoint: Annotated[Optional[dict[str, Any]], Reads("neox/config/ds_config.py")] = None
    """DeepSpeed checkpoint section (e.g. {"use_node_local_storage": true})."""

    data_types: Annotated[Optional[dict[str, Any]], Reads("neox/config/ds_config.py")] = None
    """DeepSpeed data_types section (e.g. {"grad_accum_dtype": "fp32"})."""

    prescale_gradients: Annotated[bool, Reads("neox/config/ds_config.py")] = False
    """Scale gradients before the all-reduce."""

    gradient_predivide_factor: Annotated[float, Reads("neox/config/ds_config.py")] = Field(
        1.0, gt=0, le=MAX_RANKS
    )
    """Divide gradients by this before the all-reduce."""

    sparse_gradients: Annotated[
        bool,
        Refused(
            feature="DeepSpeed no longer",
            example=True,
            allowed=(False,),
            message=(
                "sparse_gradients: DeepSpeed no longer compresses embedding gradients; set it false"
            ),
        ),
    ] = False
    """gpt-neox key for DeepSpeed's sparse embedding gradients, which DeepSpeed has removed;
    must stay false."""

    dump_state: Annotated[bool, Reads("neox/config/ds_config.py")] = False
    """Print DeepSpeed's state after initialisation."""

    deepspeed: Annotated[
        bool,
        Refused(
            feature="training without DeepSpeed",
            example=False,
            allowed=(True,),
            message=("training without DeepSpeed is not implemented in neox; remove the key"),
        ),
    ] = True
    """gpt-neox key: neox always trains through DeepSpeed, so false is refused."""

    deepspeed_extra_args: Annotated[Optional[dict[str, Any]], Reads("neox/config/ds_config.py")] = (
        None
    )
    """Anything else, merged into the DeepSpeed config as given."""

    @field_validator("*")
    @classmethod
    def _sections_finite(cls, v: Any, info: ValidationInfo) -> Any:
        check_finite(v, info.field_name)
        return v

    @field_validator("zero_optimization")
    @classmethod
    def _zero_stage(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        # DeepSpeed's own DeepSpeedZeroConfig imports torch, which `neox.config` must not; its
        # stage range is the one rule a dry run needs (the rest DeepSpeed checks at initialise).
        stage = (v or {}).get("stage", 0)
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(
                f"zero_optimization.stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3"
            )
        return v

    @property
    def stage(self) -> int:
        """The ZeRO stage: zero_optimization.stage, else gpt-neox's zero_stage shorthand, else 0."""
        return int((self.zero_optimization or {}).get("stage", self.zero_stage or 0))
