"""Logging, metrics and profiling."""

from typing import Optional

from pydantic import model_validator

from neox.config.base import ConfigGroup


class LoggingConfig(ConfigGroup):
    """What the run reports, and where."""

    log_dir: Optional[str] = None
    """Directory for text logs and the merged config of each run."""

    tensorboard_dir: Optional[str] = None
    """Directory for tensorboard event files (None: no tensorboard)."""

    log_interval: int = 10
    """Log training metrics every N iterations."""

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
    """Run torch.profiler over iterations profile_step_start..profile_step_stop on every rank and
    write a Chrome trace, the top operators and the host-sync count to <log_dir>/profile/."""

    profile_step_start: int = 10
    """First profiled iteration (1-based, as the log lines count them)."""

    profile_step_stop: int = 12
    """Last profiled iteration."""

    peak_theoretical_tflops: Optional[float] = None
    """Peak TFLOPS of one device, for the MFU in log lines and metrics.jsonl (default: the
    datasheet dense bf16 peak of H100/H200/A100; on other devices MFU is left out)."""

    use_wandb: bool = False
    """Weights & Biases logging (not available in neox: must be false)."""

    wandb_project: Optional[str] = None
    """gpt-neox key (accepted; no effect)."""

    wandb_group: Optional[str] = None
    """gpt-neox key (accepted; no effect)."""

    wandb_team: Optional[str] = None
    """gpt-neox key (accepted; no effect)."""

    wandb_host: Optional[str] = None
    """gpt-neox key (accepted; no effect)."""

    wandb_init_all_ranks: bool = False
    """gpt-neox key (accepted; no effect)."""

    @model_validator(mode="after")
    def _check_profile_steps(self) -> "LoggingConfig":
        if self.profile and not 1 <= self.profile_step_start <= self.profile_step_stop:
            raise ValueError(
                f"profile_step_start={self.profile_step_start} and profile_step_stop="
                f"{self.profile_step_stop} must satisfy 1 <= start <= stop"
            )
        return self
