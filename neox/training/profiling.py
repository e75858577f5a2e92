"""The `profile` config key: torch.profiler over chosen iterations, a trace and a summary."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from neox.config.log import LoggingConfig

log = logging.getLogger(__name__)

# Profiler events where the host waits for the device.
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class StepProfiler:
    """Profiles iterations profile_step_start..profile_step_stop (1-based) when cfg.profile.

    Call `step(n)` before running iteration n and `close()` after the loop. Writes, per rank,
    profile/rank<r>_iters<a>-<b>.trace.json (chrome://tracing, Perfetto) and .ops.txt (top
    operators by host and device time) under log_dir, and logs the host syncs per iteration.
    """

    def __init__(self, cfg: LoggingConfig, rank: int, device: torch.device) -> None:
        self.enabled = cfg.profile
        self.start, self.stop = cfg.profile_step_start, cfg.profile_step_stop
        self.rank, self.device = rank, device
        self.out_dir = Path(cfg.log_dir or ".") / "profile"
        self._prof: Optional[Any] = None

    def step(self, iteration: int) -> None:
        if not self.enabled:
            return
        if iteration == self.start and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=acts, record_shapes=False)
            self._prof.__enter__()
        elif iteration == self.stop + 1:
            self.close()

    def close(self) -> None:
        if self._prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}_iters{self.start}-{self.stop}"
        prof.export_chrome_trace(str(self.out_dir / f"{name}.trace.json"))
        avg = prof.key_averages()
        device_key = (
            "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        )
        (self.out_dir / f"{name}.ops.txt").write_text(
            avg.table(sort_by="self_cpu_time_total", row_limit=40)
            + "\n\n"
            + avg.table(sort_by=device_key, row_limit=40)
        )
        syncs = sum(e.count for e in avg if e.key in SYNC_EVENTS)
        iters = self.stop - self.start + 1
        log.info(
            "profiled iterations %d-%d: %.1f host syncs per iteration; trace and top ops in %s",
            self.start,
            self.stop,
            syncs / iters,
            self.out_dir / name,
        )
