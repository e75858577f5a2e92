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


def test_a_step_before_an_eval_a_save_or_the_end_is_timed_like_the_others(
    tmp_path, monkeypatch, one_rank_group
):
    """Fault: the step before a flush (evaluation, save, end) was logged at ~1 ms, with absurd
    TFLOPS, and the next one at two steps' time. Promise: every step is timed by its own work;
    eval and save times are reported apart. A real one-rank run of neox's loop, whose training
    batches each take at least 50 ms to arrive, so that every step takes at least 100 ms
    (2 micro-batches) however loaded the machine is."""
    import time

    import neox.training.loop as loop
    from neox.config import load_config
    from neox.training.setup import build_run
    from tests.train_helpers import make_dataset, write_config

    def slowly(stream):
        for batch in stream:
            time.sleep(0.05)
            yield batch

    def slow_train_data(*args, **kwargs):
        data = build_data(*args, **kwargs)
        data.train = slowly(data.train)
        return data

    build_data = loop.build_data
    monkeypatch.setattr(loop, "build_data", slow_train_data)
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)  # what init_distributed sets, restored afterwards
    make_dataset(tmp_path / "data" / "chars")
    steps = dict(train_iters=8, eval_interval=3, checkpoint_factor=4, log_interval=1)
    cfg = load_config([write_config(tmp_path, "run", num_gpus=1, **steps)]).config
    assert cfg.training.gradient_accumulation_steps == 2
    run = build_run(cfg)
    writer = MetricsWriter(cfg.logging.log_dir, None, enabled=True)
    try:
        loop.train(run, 0, writer)
    finally:
        writer.close()
    lines = (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    times = {r["step"]: r["step_time_s"] for r in records if r["split"] == "train"}
    assert sorted(times) == list(range(1, 9))
    # Steps 3 and 6 precede an evaluation, 4 and 8 a save, 8 the end: each still took its two
    # batches' 100 ms, none is a mere read of its loss.
    assert all(t >= 0.1 for t in times.values()), times
    assert {r["split"] for r in records} >= {"valid", "save"}
    assert all(r["eval_time_s"] > 0 for r in records if r["split"] == "valid")
    assert all(r["save_time_s"] > 0 for r in records if r["split"] == "save")
    # The wait for a previous save's write is part of the save's time (none here: sync saves).
    assert all(0 <= r["save_wait_s"] <= r["save_time_s"] for r in records if r["split"] == "save")
