"""What a run reports: a log line, tensorboard scalars and a JSON-lines file per interval."""

import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peak per GPU, in TFLOPS (datasheet, without sparsity). Longer names
# first: "H100 PCIe" must win over "H100".
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "A100": 312.0,
}


def peak_tflops(device: Any) -> Optional[float]:
    """Datasheet bf16 peak of a CUDA device, or None where unknown (CPU, other GPUs)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


class Throughput:
    """TFLOPS per GPU and MFU from tokens/s, with neox.estimate's FLOPs per token (6N + 12Lhs,
    model FLOPs: activation recomputation is not counted, as MFU defines it)."""

    def __init__(self, cfg: Any, derived: Any, device: Any) -> None:
        from neox.estimate import train_flops_per_token

        self.flops_per_token = train_flops_per_token(cfg.model, derived.padded_vocab_size)
        self.world_size = derived.world_size
        self.peak = cfg.logging.peak_theoretical_tflops or peak_tflops(device)

    def metrics(self, tokens_per_s: float) -> dict[str, float]:
        tflops = tokens_per_s * self.flops_per_token / self.world_size / 1e12
        out = {"tflops_per_gpu": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out


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
