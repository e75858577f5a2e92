"""Logging, metrics and profiling."""

from typing import Annotated, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator, model_validator

from neox.config.base import MAX_COUNT, ConfigGroup, Reads, Refused


class LoggingConfig(ConfigGroup):
    """What the run reports, and where."""

    log_dir: Annotated[Optional[str], Reads("neox/training/loop.py")] = None
    """Directory for text logs and the merged config of each run."""

    tensorboard_dir: Annotated[Optional[str], Reads("neox/training/loop.py")] = None
    """Directory for tensorboard event files (None: no tensorboard)."""

    log_level: Annotated[Literal["info", "debug"], Reads("neox/entry.py")] = "info"
    """What the ranks print. info: rank 0 speaks for the job, the other ranks give only their
    own warnings and errors, and library notes that ask nothing of the user are dropped. debug
    (what `deepy.py --verbose` sets, also printing the launch command): every rank at info,
    neox's own debug lines (the flat engine's `step=, lr=` line, eval's partial results),
    nothing dropped."""

    log_interval: Annotated[int, Reads("neox/training/loop.py")] = Field(10, ge=1, le=MAX_COUNT)
    """Log training metrics every N iterations (>= 1)."""

    steps_per_print: Annotated[int, Reads("neox/config/ds_config.py")] = Field(
        10, ge=1, le=MAX_COUNT
    )
    """DeepSpeed's own progress print interval (on the flat engine its `step=, lr=` line shows at
    log_level debug: the log_interval line gives both)."""

    wall_clock_breakdown: Annotated[bool, Reads("neox/config/ds_config.py")] = False
    """DeepSpeed timing of forward/backward/step."""

    log_grad_norm: Annotated[bool, Reads("neox/training/loop.py")] = True
    """Log the global gradient norm (on by default in neox, unlike gpt-neox: it is cheap and the
    first thing to look at when a loss spikes)."""

    log_param_norm: Annotated[
        bool,
        Refused(
            feature="log_param_norm is not implemented",
            example=True,
            allowed=(False,),
            message=("{key} is not implemented in neox; set it false (log_grad_norm works)"),
        ),
    ] = False
    """Log the global parameter norm (not implemented: must be false)."""

    log_grad_pct_zeros: Annotated[
        bool,
        Refused(
            feature="log_grad_pct_zeros is not implemented",
            example=True,
            allowed=(False,),
            message=("{key} is not implemented in neox; set it false (log_grad_norm works)"),
        ),
    ] = False
    """Log the fraction of zero gradients (not implemented: must be false)."""

    log_optimizer_states: Annotated[
        bool,
        Refused(
            feature="log_optimizer_states is not implemented",
            example=True,
            allowed=(False,),
            message=("{key} is not implemented in neox; set it false (log_grad_norm works)"),
        ),
    ] = False
    """Log optimizer state norms (not implemented: must be false)."""

    git_hash: Annotated[Optional[str], Reads("deepy.py")] = None
    """Commit of the code; deepy.py fills it in from the git checkout it runs in, so the config
    saved with each run and checkpoint names the code that produced it."""

    memory_profiling: Annotated[
        bool,
        Refused(
            feature="CUDA memory snapshots",
            example=True,
            allowed=(False,),
            message=(
                "CUDA memory snapshots (memory_profiling) are not implemented in neox; set it false"
            ),
        ),
    ] = False
    """Record a CUDA memory snapshot (gpt-neox key; not implemented: must be false)."""

    memory_profiling_path: Optional[str] = None
    """No-op: where gpt-neox's memory snapshot goes (memory_profiling is refused)."""

    profile: Annotated[bool, Reads("neox/training/profiling.py")] = False
    """Run torch.profiler over iterations profile_step_start..profile_step_stop on every rank and
    write a Chrome trace, the top operators and the host-sync count to <log_dir>/profile/."""

    profile_step_start: Annotated[int, Reads("neox/training/profiling.py")] = Field(
        10, ge=1, le=MAX_COUNT
    )
    """First profiled iteration (1-based, as the log lines count them)."""

    profile_step_stop: Annotated[int, Reads("neox/training/profiling.py")] = Field(
        12, ge=1, le=MAX_COUNT
    )
    """Last profiled iteration."""

    peak_theoretical_tflops: Annotated[Optional[float], Reads("neox/training/metrics.py")] = Field(
        None, gt=0, le=1e6
    )
    """Peak TFLOPS of one device, for the MFU in log lines and metrics.jsonl (default: the
    datasheet dense bf16 peak of H100/H200/A100; on other devices MFU is left out)."""

    use_wandb: Annotated[bool, Reads("neox/training/loop.py")] = False
    """Log the metrics to Weights & Biases from rank 0 (needs `pip install neox[wandb]`;
    WANDB_MODE=offline keeps the run local)."""

    wandb_project: Annotated[Optional[str], Reads("neox/training/progress.py")] = None
    """W&B project (None: `neox`)."""

    wandb_group: Annotated[Optional[str], Reads("neox/training/progress.py")] = None
    """W&B group of runs."""

    wandb_team: Annotated[Optional[str], Reads("neox/training/progress.py")] = None
    """W&B entity (team or user)."""

    wandb_host: Annotated[Optional[str], Reads("neox/training/progress.py")] = None
    """Weights & Biases server URL, for a self-hosted server (None: W&B's own, or
    WANDB_BASE_URL); the run records it, so an offline run syncs there too."""

    wandb_init_all_ranks: Annotated[bool, Reads("neox/training/loop.py")] = False
    """Start a Weights & Biases run on every rank, not only rank 0; the other ranks' runs hold
    their own system metrics, rank 0's the training metrics."""

    wandb_run_name: Annotated[Optional[str], Reads("neox/training/progress.py")] = None
    """Weights & Biases run name."""

    @field_validator("wandb_project", "wandb_team")
    @classmethod
    def _wandb_name(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        # W&B refuses these names at wandb.init, on rank 0 after launch.
        if v is not None and (not v or len(v) > 128 or set(v) & set("/\\#?%:")):
            raise ValueError(
                f"{info.field_name}={v!r} is not a W&B name: 1 to 128 characters, none of "
                "/ \\ # ? % :"
            )
        return v

    @model_validator(mode="after")
    def _profile_window(self) -> "LoggingConfig":
        if self.profile and not self.profile_step_start <= self.profile_step_stop:
            raise ValueError(
                f"profile_step_start={self.profile_step_start} and profile_step_stop="
                f"{self.profile_step_stop} must satisfy 1 <= start <= stop"
            )
        return self
