"""What a run reports: a log line, tensorboard scalars and a JSON-lines file per interval."""

import json
import logging
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)


class MetricsWriter:
    """Writes on one rank only (the caller decides which); a no-op elsewhere."""

    def __init__(self, log_dir: Optional[str], tensorboard_dir: Optional[str], enabled: bool):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self._jsonl = open(Path(log_dir) / "metrics.jsonl", "a")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)

    def write(self, step: int, scalars: dict[str, float], prefix: str = "train") -> None:
        if not self.enabled:
            return
        if self._jsonl:
            record = {"step": step, "split": prefix, "time": time.time(), **scalars}
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb:
            for name, value in scalars.items():
                self._tb.add_scalar(f"{prefix}/{name}", value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()


def format_line(step: int, total: int, scalars: dict[str, float]) -> str:
    parts = [f"iter {step:>6}/{total}"]
    for name, value in scalars.items():
        parts.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
    return " | ".join(parts)
