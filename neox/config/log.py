"""Logging, metrics and profiling."""

from typing import Optional

from pydantic import field_validator

from neox.config.base import ConfigGroup


class LoggingConfig(ConfigGroup):
    """What the run reports, and where."""

    log_dir: Optional[str] = None
    """Directory for text logs and the merged config of each run."""

    tensorboard_dir: Optional[str] = None
    """Directory for tensorboard event files (None: no tensorboard)."""

    log_interval: int = 10
    """Log training metrics every N iterations (>= 1)."""

    steps_per_print: int = 10
    """DeepSpeed's own progress print interval."""

    wall_clock_breakdown: bool = False
    """DeepSpeed timing of forward/backward/step."""

    log_grad_norm: bool = False
    """Log the global gradient norm."""

    log_param_norm: bool = False
    """Log the global parameter norm."""

    log_grad_pct_zeros: bool = False
    """Log the fraction of zero gradients."""

    log_optimizer_states: bool = False
    """Log optimizer state norms."""

    log_gradient_noise_scale: bool = False
    """Log the gradient noise scale (gpt-neox key; not implemented, must be false)."""

    git_hash: Optional[str] = None
    """Commit of the code (filled in by deepy.py when run from a git checkout)."""

    memory_profiling: bool = False
    """Record a CUDA memory snapshot (gpt-neox key)."""

    memory_profiling_path: Optional[str] = None
    """Where the memory snapshot goes."""

    profile: bool = False
    """Run the torch profiler between profile_step_start and profile_step_stop."""

    profile_step_start: int = 10
    """First profiled iteration."""

    profile_step_stop: int = 12
    """Last profiled iteration."""

    use_wandb: bool = False
    """Log the metrics to Weights & Biases from rank 0 (needs `pip install neox[wandb]`;
    WANDB_MODE=offline keeps the run local)."""

    wandb_project: Optional[str] = None
    """W&B project (None: `neox`)."""

    wandb_group: Optional[str] = None
    """W&B group of runs."""

    wandb_team: Optional[str] = None
    """W&B entity (team or user)."""

    wandb_host: Optional[str] = None
    """gpt-neox key (accepted; no effect)."""

    wandb_init_all_ranks: bool = False
    """gpt-neox key (accepted; no effect)."""

    @field_validator("log_interval")
    @classmethod
    def _interval_positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"log_interval={v} must be >= 1")
        return v
