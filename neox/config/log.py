"""Logging, metrics and profiling."""

from typing import Optional

from pydantic import model_validator

from neox.config.base import ConfigGroup, at_least, refuse_unless


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

    log_grad_norm: bool = True
    """Log the global gradient norm (on by default in neox, unlike gpt-neox: it is cheap and the
    first thing to look at when a loss spikes)."""

    log_param_norm: bool = False
    """Log the global parameter norm (not implemented: must be false)."""

    log_grad_pct_zeros: bool = False
    """Log the fraction of zero gradients (not implemented: must be false)."""

    log_optimizer_states: bool = False
    """Log optimizer state norms (not implemented: must be false)."""

    git_hash: Optional[str] = None
    """Commit of the code; deepy.py fills it in from the git checkout it runs in, so the config
    saved with each run and checkpoint names the code that produced it."""

    memory_profiling: bool = False
    """Record a CUDA memory snapshot (gpt-neox key; not implemented: must be false)."""

    memory_profiling_path: Optional[str] = None
    """No-op: where gpt-neox's memory snapshot goes (memory_profiling is refused)."""

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
    """Log the metrics to Weights & Biases from rank 0 (needs `pip install neox[wandb]`;
    WANDB_MODE=offline keeps the run local)."""

    wandb_project: Optional[str] = None
    """W&B project (None: `neox`)."""

    wandb_group: Optional[str] = None
    """W&B group of runs."""

    wandb_team: Optional[str] = None
    """W&B entity (team or user)."""

    wandb_host: Optional[str] = None
    """Weights & Biases server URL, for a self-hosted server (None: W&B's own, or
    WANDB_BASE_URL); the run records it, so an offline run syncs there too."""

    wandb_init_all_ranks: bool = False
    """Start a Weights & Biases run on every rank, not only rank 0; the other ranks' runs hold
    their own system metrics, rank 0's the training metrics."""

    wandb_run_name: Optional[str] = None
    """Weights & Biases run name."""

    _unimplemented_norms = refuse_unless(
        "log_param_norm",
        "log_grad_pct_zeros",
        "log_optimizer_states",
        allowed=(False,),
        message="{key} is not implemented in neox; set it false (log_grad_norm works)",
    )
    _no_memory_profiling = refuse_unless(
        "memory_profiling",
        allowed=(False,),
        message="CUDA memory snapshots (memory_profiling) are not implemented in neox; set it false",
    )
    _interval_positive = at_least("log_interval", least=1)

    @model_validator(mode="after")
    def _check_profile_steps(self) -> "LoggingConfig":
        if self.profile and not 1 <= self.profile_step_start <= self.profile_step_stop:
            raise ValueError(
                f"profile_step_start={self.profile_step_start} and profile_step_stop="
                f"{self.profile_step_stop} must satisfy 1 <= start <= stop"
            )
        return self
