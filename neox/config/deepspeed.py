"""DeepSpeed sections neox does not interpret: passed into the DeepSpeed config as written."""

from typing import Any, Optional

from neox.config.base import ConfigGroup, refuse_unless


class DeepSpeedConfig(ConfigGroup):
    """DeepSpeed's own config sections and gpt-neox's shorthands for them."""

    zero_optimization: Optional[dict[str, Any]] = None
    """DeepSpeed ZeRO section, e.g. {"stage": 1, "overlap_comm": true}."""

    zero_stage: Optional[int] = None
    """gpt-neox shorthand for zero_optimization.stage."""

    zero_reduce_scatter: Optional[bool] = None
    """gpt-neox shorthand for zero_optimization.reduce_scatter."""

    zero_contiguous_gradients: Optional[bool] = None
    """gpt-neox shorthand for zero_optimization.contiguous_gradients."""

    zero_reduce_bucket_size: Optional[int] = None
    """gpt-neox shorthand for zero_optimization.reduce_bucket_size."""

    zero_allgather_bucket_size: Optional[int] = None
    """gpt-neox shorthand for zero_optimization.allgather_bucket_size."""

    activation_checkpointing: Optional[dict[str, Any]] = None
    """DeepSpeed activation checkpointing section (derived from checkpoint_* keys when unset)."""

    flops_profiler: Optional[dict[str, Any]] = None
    """DeepSpeed flops profiler section."""

    comms_logger: Optional[dict[str, Any]] = None
    """DeepSpeed communication logger section."""

    autotuning: Optional[dict[str, Any]] = None
    """DeepSpeed autotuning section."""

    elasticity: Optional[dict[str, Any]] = None
    """DeepSpeed elasticity section."""

    csv_monitor: Optional[dict[str, Any]] = None
    """DeepSpeed CSV monitor section."""

    checkpoint: Optional[dict[str, Any]] = None
    """DeepSpeed checkpoint section (e.g. {"use_node_local_storage": true})."""

    data_types: Optional[dict[str, Any]] = None
    """DeepSpeed data_types section (e.g. {"grad_accum_dtype": "fp32"})."""

    prescale_gradients: bool = False
    """Scale gradients before the all-reduce."""

    gradient_predivide_factor: float = 1.0
    """Divide gradients by this before the all-reduce."""

    sparse_gradients: bool = False
    """gpt-neox key for DeepSpeed's sparse embedding gradients, which DeepSpeed has removed;
    must stay false."""

    _no_sparse_gradients = refuse_unless(
        "sparse_gradients",
        allowed=(False,),
        message="sparse_gradients: DeepSpeed no longer compresses embedding gradients; set it "
        "false",
    )

    dump_state: bool = False
    """Print DeepSpeed's state after initialisation."""

    deepspeed: bool = True
    """gpt-neox key: neox always trains through DeepSpeed, so false is refused."""

    _always_deepspeed = refuse_unless(
        "deepspeed",
        allowed=(True,),
        message="training without DeepSpeed is not implemented in neox; remove the key",
    )

    deepspeed_extra_args: Optional[dict[str, Any]] = None
    """Anything else, merged into the DeepSpeed config as given."""
