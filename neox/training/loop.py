"""The training loop as short named steps: train_step, evaluate, train."""

import logging
import time
from collections.abc import Iterator
from typing import Optional

import torch

from neox.checkpoint.io import load_checkpoint, save_checkpoint, should_save
from neox.config import write_config
from neox.data.batch import Batch, build_batch
from neox.parallel import pipeline_batch
from neox.training.metrics import MetricsWriter, Throughput, format_line
from neox.training.profiling import StepProfiler
from neox.training.setup import Run, build_data, build_run

log = logging.getLogger(__name__)


def next_batch(run: Run, stream: Iterator) -> Batch:
    """One micro-batch on the device, with labels, loss mask and positions."""
    d = run.cfg.data
    text = next(stream)["text"].to(run.device, non_blocking=True)
    return build_batch(
        text, run.tokenizer.eod, d.eod_mask_loss, d.reset_position_ids, d.reset_attention_mask
    )


def pipeline_stream(run: Run, stream: Iterator) -> Iterator:
    """Micro-batches in the (inputs, labels) form DeepSpeed's pipeline engine consumes."""
    while True:
        b = next_batch(run, stream)
        yield pipeline_batch(b.tokens, b.labels, b.loss_mask)


def forward_loss(run: Run, batch: Batch) -> torch.Tensor:
    """The model returns the loss itself, so the output layer and the loss can run fused."""
    b = batch
    return run.engine(b.tokens, b.position_ids, b.attention_mask, b.labels, b.loss_mask)


def train_step(run: Run, stream: Iterator, iteration: int) -> dict[str, float]:
    """One optimizer step over gradient_accumulation_steps micro-batches."""
    lr = run.schedule.apply(run.engine.optimizer, iteration)
    if run.is_pipeline:
        loss = run.engine.train_batch(data_iter=stream)
    else:
        losses = []
        for _ in range(run.derived.grad_accum):
            loss = forward_loss(run, next_batch(run, stream))
            run.engine.backward(loss)
            run.engine.step()
            losses.append(loss.detach())
        loss = torch.stack(losses).mean()
    metrics = {"loss": reduce_mean(run, loss), "lr": lr}
    grad_norm = run.engine.get_global_grad_norm()
    if run.cfg.logging.log_grad_norm and grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    scale = getattr(run.engine.optimizer, "cur_scale", None)
    if run.derived.precision == "fp16" and scale is not None:
        metrics["loss_scale"] = float(scale)
    return metrics


def reduce_mean(run: Run, loss: torch.Tensor) -> float:
    """Mean of a loss over the data-parallel ranks."""
    loss = loss.detach().float().clone()
    group = run.groups.get_data_parallel_group()
    torch.distributed.all_reduce(loss, group=group)
    return loss.item() / torch.distributed.get_world_size(group=group)


@torch.no_grad()
def evaluate(run: Run, stream: Iterator, iters: int) -> float:
    """Mean loss over `iters` batches (each gradient_accumulation_steps micro-batches)."""
    run.engine.eval()
    total = 0.0
    for _ in range(iters):
        if run.is_pipeline:
            total += reduce_mean(run, run.engine.eval_batch(data_iter=stream))
        else:
            losses = [
                forward_loss(run, next_batch(run, stream)) for _ in range(run.derived.grad_accum)
            ]
            total += reduce_mean(run, torch.stack(losses).mean())
    run.engine.train()
    return total / max(1, iters)


def train(run: Run, start_iteration: int, writer: MetricsWriter) -> dict[str, float]:
    """Train from start_iteration to train_iters, evaluating, logging and saving on schedule."""
    cfg, d = run.cfg, run.derived
    t = cfg.training
    data = build_data(run, consumed_train_samples=start_iteration * d.global_batch)
    train_stream = pipeline_stream(run, data.train) if run.is_pipeline else data.train
    valid_stream = None
    if data.valid is not None:
        valid_stream = pipeline_stream(run, data.valid) if run.is_pipeline else data.valid
    last: dict[str, float] = {}
    iteration = start_iteration
    speed = Throughput(cfg, d, run.device)
    profiler = StepProfiler(cfg.logging, run.rank, run.device)
    tick = time.perf_counter()
    if not t.do_train:
        log.info("do_train=false: evaluating the loaded weights only")
        if valid_stream is not None and t.do_valid:
            eval_loss = evaluate(run, valid_stream, t.eval_iters)
            writer.write(iteration, {"loss": eval_loss}, prefix="valid")
    while t.do_train and iteration < t.train_iters:
        profiler.step(iteration + 1)
        metrics = train_step(run, train_stream, iteration)
        iteration += 1
        last = metrics
        if iteration % cfg.logging.log_interval == 0 or iteration == t.train_iters:
            elapsed = (time.perf_counter() - tick) / cfg.logging.log_interval
            tick = time.perf_counter()
            metrics["step_time_s"] = elapsed
            metrics["tokens_per_s"] = d.global_batch * cfg.model.seq_length / max(elapsed, 1e-9)
            metrics.update(speed.metrics(metrics["tokens_per_s"]))
            if run.is_logging_rank:
                log.info(format_line(iteration, t.train_iters, metrics))
            writer.write(iteration, metrics)
        if valid_stream is not None and t.do_valid and iteration % t.eval_interval == 0:
            eval_loss = evaluate(run, valid_stream, t.eval_iters)
            if run.is_logging_rank:
                log.info("validation at iter %d: loss %.4f", iteration, eval_loss)
            writer.write(iteration, {"loss": eval_loss}, prefix="valid")
        if should_save(cfg, iteration):
            save(run, iteration)
        if t.exit_interval and iteration % t.exit_interval == 0:
            log.info("exit_interval=%d reached at iteration %d", t.exit_interval, iteration)
            break
    profiler.close()
    if cfg.checkpoint.save and not should_save(cfg, iteration) and iteration > start_iteration:
        save(run, iteration)
    if t.do_test and data.test is not None and (iteration >= t.train_iters or not t.do_train):
        test_stream = pipeline_stream(run, data.test) if run.is_pipeline else data.test
        test_loss = evaluate(run, test_stream, t.eval_iters)
        writer.write(iteration, {"loss": test_loss}, prefix="test")
        if run.is_logging_rank:
            log.info("test loss %.4f", test_loss)
    return last


def save(run: Run, iteration: int) -> None:
    consumed = iteration * run.derived.global_batch
    save_checkpoint(run.engine, run.cfg, iteration, {"consumed_train_samples": consumed})


def run_training(cfg, run: Optional[Run] = None) -> dict[str, float]:
    """The whole job on this rank: build, resume, train; returns the last step's metrics."""
    run = run or build_run(cfg)
    state = load_checkpoint(run.engine, cfg) or {}
    start = int(state.get("iteration", 0))
    lg = cfg.logging
    writer = MetricsWriter(lg.log_dir, lg.tensorboard_dir, enabled=run.is_logging_rank)
    if run.is_logging_rank and lg.log_dir:
        write_config(cfg, f"{lg.log_dir}/config.yml")
    try:
        return train(run, start, writer)
    finally:
        writer.close()
