"""What a run reports: a log line, tensorboard scalars and a JSON-lines file per interval."""

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import psutil
import torch

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

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


class ModelFlops:
    """TFLOPS per GPU and MFU from tokens/s, with neox.plan.estimate's FLOPs per token (6N + 12Lhs,
    model FLOPs: activation recomputation is not counted, as MFU defines it)."""

    def __init__(self, cfg: Any, derived: Any, device: Any) -> None:
        from neox.plan.estimate import train_flops_per_token

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
    """Writes on one rank only (the caller decides which); a no-op elsewhere.

    A run resumed at `start_step` first drops what an earlier attempt logged after that step
    (from metrics.jsonl and tensorboard), so replayed steps appear once.
    """

    def __init__(
        self,
        log_dir: Optional[str],
        tensorboard_dir: Optional[str],
        enabled: bool,
        start_step: int = 0,
    ):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        if log_dir:
            path = Path(log_dir) / METRICS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            drop_records_after(path, start_step)
            self._jsonl = open(path, "a")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir, purge_step=start_step + 1)

    def attach_wandb(self, run) -> None:
        self._wandb = run

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
        if self._wandb is not None:
            self._wandb.log({f"{prefix}/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def drop_records_after(path: Path, step: int) -> None:
    """Rewrite a metrics file without the records past `step` (by rename: never half a file)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    log.info("%s: dropped %d records logged after step %d", path, len(lines) - len(kept), step)


def memory_metrics(device: torch.device) -> dict[str, float]:
    """GPU memory allocated, reserved and the peak allocated so far, or the process's resident
    memory on CPU (GB)."""
    if device.type == "cuda":
        return {
            "mem_allocated_gb": torch.cuda.memory_allocated(device) / 2**30,
            "mem_reserved_gb": torch.cuda.memory_reserved(device) / 2**30,
            "mem_peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
        }
    return {"rss_gb": psutil.Process().memory_info().rss / 2**30}


class DeviceScalars:
    """A step's scalars, read on the host only when needed. Tensors on a GPU are copied to
    pinned host memory as the step's last work, so `read` waits for this step alone and not
    for the steps queued after it: the loop reads step i once step i+1 is queued, and the
    device never idles while the host logs."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._order = [k for k, v in values.items() if v is not None]
        on_gpu = {
            k for k in self._order if isinstance(values[k], torch.Tensor) and values[k].is_cuda
        }
        self._plain = {k: float(values[k]) for k in self._order if k not in on_gpu}
        self._names = [k for k in self._order if k in on_gpu]
        self._host: Optional[torch.Tensor] = None
        self._event = None
        if not self._names:
            return
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in self._names])
        self._host = torch.empty(stacked.shape, dtype=torch.float32, pin_memory=True)
        self._host.copy_(stacked, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def read(self) -> dict[str, float]:
        if self._event is not None:
            self._event.synchronize()
        values = dict(self._plain)
        if self._host is not None:
            values.update(zip(self._names, self._host.tolist()))
        return {k: values[k] for k in self._order}


class Throughput:
    """Training time only (evaluation and saving are timed apart), per log interval."""

    def __init__(self, start_step: int, total_steps: int) -> None:
        self.start_step, self.total_steps = start_step, total_steps
        self.interval_s = 0.0
        self.interval_steps = 0
        self.total_s = 0.0

    def add(self, seconds: float) -> None:
        self.interval_s += seconds
        self.interval_steps += 1
        self.total_s += seconds

    def take(self, step: int, global_batch: int, seq_length: int, world: int) -> dict[str, float]:
        """Step time, samples and tokens per second, ETA; starts the next interval."""
        step_s = self.interval_s / max(1, self.interval_steps)
        samples_s = global_batch / max(step_s, 1e-9)
        done = step - self.start_step
        self.interval_s, self.interval_steps = 0.0, 0
        return {
            "step_time_s": step_s,
            "samples_per_s": samples_s,
            "tokens_per_s": samples_s * seq_length,
            "tokens_per_s_per_gpu": samples_s * seq_length / world,
            "eta_s": self.total_s / max(1, done) * (self.total_steps - step),
        }


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_line(step: int, total: int, m: dict[str, float]) -> str:
    """One compact line: iteration, data seen, loss, lr, norms, speed, memory, ETA."""
    parts = [f"iter {step}/{total}"]
    if "consumed_tokens" in m:
        parts.append(f"samples {_si(m['consumed_samples'])} tokens {_si(m['consumed_tokens'])}")
    if "trained_tokens" in m and m.get("consumed_trained_tokens") != m.get("consumed_tokens"):
        parts.append(f"trained {_si(m['trained_tokens'])}/step")
    parts.append(f"loss {m['loss']:.4f}")
    parts.append(f"lr {m['lr']:.3g}")
    for key, label in (("grad_norm", "gnorm"), ("loss_scale", "scale")):
        if key in m:
            parts.append(f"{label} {m[key]:.3g}")
    if m.get("skipped_steps") or m.get("nonfinite_steps"):
        parts.append(f"skipped {m['skipped_steps']} nonfinite {m['nonfinite_steps']}")
    if m.get("restarts"):  # a relaunch of deepy.py's max_restarts
        parts.append(f"restart {m['restarts']}")
    if "step_time_s" in m:
        parts.append(
            f"{m['step_time_s'] * 1000:.0f} ms/step {_si(m['tokens_per_s'])} tok/s "
            f"({_si(m['tokens_per_s_per_gpu'])}/gpu)"
        )
    for key in ("tflops_per_gpu", "mfu"):
        if key in m:
            parts.append(f"{key} {m[key]:.3g}")
    if "mem_allocated_gb" in m:
        parts.append(f"mem {m['mem_allocated_gb']:.2f}/{m['mem_reserved_gb']:.2f} GB")
    elif "rss_gb" in m:
        parts.append(f"rss {m['rss_gb']:.2f} GB")
    if "eta_s" in m:
        parts.append(f"eta {_duration(m['eta_s'])}")
    return " | ".join(parts)


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl (run_dir may be the log_dir or the file itself)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a run's log_dir (it holds {METRICS_FILE})")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
