"""Metrics pieces: the resumed-run file rewrite, throughput and ETA, the compact line."""

import json

import pytest
import torch

from neox.training.metrics import (
    DeviceScalars,
    MetricsWriter,
    Throughput,
    drop_records_after,
    format_line,
)


def test_resume_drops_records_logged_after_the_checkpoint(tmp_path):
    w = MetricsWriter(str(tmp_path), None, enabled=True)
    for step in range(1, 6):
        w.write(step, {"loss": float(step)})
    w.write(3, {"loss": 0.5}, prefix="valid")
    w.close()
    w = MetricsWriter(str(tmp_path), None, enabled=True, start_step=3)
    w.write(4, {"loss": 40.0})
    w.close()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["split"], r["step"], r["loss"]) for r in recs] == [
        ("train", 1, 1.0),
        ("train", 2, 2.0),
        ("train", 3, 3.0),
        ("valid", 3, 0.5),
        ("train", 4, 40.0),
    ]
    drop_records_after(tmp_path / "absent.jsonl", 0)  # nothing to do, no error


def test_throughput_counts_training_time_only_and_estimates_the_rest():
    speed = Throughput(start_step=10, total_steps=30)
    for _ in range(4):
        speed.add(0.5)
    m = speed.take(step=14, global_batch=8, seq_length=32, world=2)
    assert m["step_time_s"] == 0.5 and m["samples_per_s"] == 16
    assert m["tokens_per_s"] == 512 and m["tokens_per_s_per_gpu"] == 256
    assert m["eta_s"] == pytest.approx(0.5 * 16)
    speed.add(1.5)
    assert speed.take(step=15, global_batch=8, seq_length=32, world=2)["step_time_s"] == 1.5


def test_line_holds_every_value_compactly():
    m = {
        "loss": 4.56789,
        "lr": 3e-4,
        "grad_norm": 0.91,
        "loss_scale": 65536.0,
        "skipped_steps": 2,
        "nonfinite_steps": 1,
        "consumed_samples": 1600,
        "consumed_tokens": 3276800,
        "step_time_s": 0.25,
        "tokens_per_s": 13107200 / 1000,
        "tokens_per_s_per_gpu": 13107200 / 8000,
        "mem_allocated_gb": 1.5,
        "mem_reserved_gb": 2.0,
        "eta_s": 3725,
    }
    line = format_line(200, 1000, m)
    assert line == (
        "iter 200/1000 | samples 1.6k tokens 3.28M | loss 4.5679 | lr 0.0003 | gnorm 0.91 | "
        "scale 6.55e+04 | skipped 2 nonfinite 1 | 250 ms/step 13.1k tok/s (1.64k/gpu) | "
        "mem 1.50/2.00 GB | eta 1:02:05"
    )


def test_device_scalars_keep_order_drop_none_and_read_tensors():
    scalars = DeviceScalars(
        {"loss": torch.tensor(2.5), "lr": 1e-3, "grad_norm": None, "skipped": False}
    )
    read = scalars.read()
    assert list(read) == ["loss", "lr", "skipped"]
    assert read == {"loss": 2.5, "lr": 1e-3, "skipped": 0.0}
    assert all(type(v) is float for v in read.values())
