"""The training loop as short named steps: train_step, evaluate, train."""

import logging
import math
import signal
import time
from collections.abc import Iterator
from typing import Optional

import torch

from neox.checkpoint.io import (
    last_saved,
    load_checkpoint,
    poisoned,
    save_checkpoint,
    should_save,
    wait_for_saves,
)
from neox.config import write_config
from neox.config.derived import consumed_samples
from neox.data.batch import Batch, build_batch
from neox.launcher.liveness import beat, rest, restart
from neox.model.moe import router_metrics
from neox.parallel.context import context_chunk
from neox.training.metrics import (
    DeviceScalars,
    MetricsWriter,
    ModelFlops,
    Throughput,
    format_line,
    memory_metrics,
)
from neox.training.profiling import StepProfiler
from neox.training.progress import Progress, start_wandb
from neox.training.setup import Run, build_data, build_run
from neox.training.stop import StopSignal

log = logging.getLogger(__name__)


def next_batch(run: Run, stream: Iterator) -> Batch:
    """One micro-batch on the device, with labels, loss mask and positions."""
    if run.objective is not None:  # train_impl dpo/kto/rm: whole documents, pairs or rewards
        return run.objective.batch(next(stream), run.device)
    d = run.cfg.data
    data = next(stream)
    text = data["text"].to(run.device, non_blocking=True)
    label = data.get("label")
    batch = build_batch(
        text,
        run.tokenizer.eod,
        d.eod_mask_loss,
        d.reset_position_ids,
        d.reset_attention_mask,
        None if label is None else label.to(run.device, non_blocking=True),
    )
    # Positions and documents come from the whole sequence; then this rank's chunk of it.
    g = run.groups
    return context_chunk(batch, g.coord.context, g.topo.cp)


def micro_batches(run: Run, stream: Iterator) -> Iterator[Batch]:
    """The micro-batches of `stream`, built as the engine takes them."""
    while True:
        yield next_batch(run, stream)


def train_step(run: Run, stream: Iterator, iteration: int) -> DeviceScalars:
    """One optimizer step over gradient_accumulation_steps micro-batches, by the engine. Its
    metrics stay on the device until read: nothing here waits for the device."""
    lr = run.schedule.apply(run.engine.optimizer, iteration)
    step = run.engine.train_batch(micro_batches(run, stream))
    metrics = {"loss": data_parallel_mean(run, step.loss), "lr": lr, **objective_metrics(run)}
    if run.cfg.logging.log_grad_norm:
        metrics["grad_norm"] = step.grad_norm
    metrics["skipped"] = step.skipped
    metrics["loss_scale"] = step.loss_scale  # None (not written) outside fp16
    metrics["trained_tokens"] = step.trained_tokens  # the loss's denominator, global batch
    metrics.update(moe_metrics(run))
    return DeviceScalars(metrics)


def data_parallel_mean(run: Run, loss: torch.Tensor) -> torch.Tensor:
    """Mean of a loss over the data-parallel ranks, left on the device."""
    loss = loss.detach().float().clone()
    group = run.groups.get_data_parallel_group()
    torch.distributed.all_reduce(loss, group=group)
    return loss / torch.distributed.get_world_size(group=group)


def moe_metrics(run: Run) -> dict[str, torch.Tensor]:
    """The MoE layers' router losses and expert load of the step's last micro-batch, averaged
    over the data-parallel ranks in one all-reduce (none for a dense model)."""
    names, values = router_metrics(run.engine.module)
    if not names:
        return {}
    return dict(zip(names, data_parallel_mean(run, torch.stack(values)).unbind()))


def objective_metrics(run: Run) -> dict[str, torch.Tensor]:
    """A train_impl's metrics (rewards, accuracy, margins) since the last call, averaged over
    the data-parallel ranks; none for language modelling."""
    if run.objective is None:
        return {}
    return {k: data_parallel_mean(run, v) for k, v in run.objective.take_metrics().items()}


def reduce_mean(run: Run, loss: torch.Tensor) -> float:
    """Mean of a loss over the data-parallel ranks."""
    return data_parallel_mean(run, loss).item()


@torch.no_grad()
def evaluate(run: Run, stream: Iterator, iters: int) -> float:
    """Mean loss over `iters` batches (each gradient_accumulation_steps micro-batches)."""
    run.engine.eval()
    objective_metrics(run)  # what evaluation records starts here
    total = 0.0
    for _ in range(iters):
        total += reduce_mean(run, run.engine.eval_batch(micro_batches(run, stream)))
    run.engine.train()
    return total / max(1, iters)


class NonFiniteSteps(RuntimeError):
    """Too many steps in a row with a non-finite loss or gradient: the run stops unsaved."""


class StepRecords:
    """What the host does with each finished step: counters, the guard against non-finite
    steps, the progress bar, log lines and metrics files. It runs one step behind the device
    (step i is recorded once step i+1 is queued, see DeviceScalars); `flush` records the last
    step before anything that needs it: evaluation, a save, a stop, the end.

    Step i's time runs from when the host was free to queue it (after recording step i-1, or
    after an evaluation or save) to when step i+1 began, or for a flushed step to when its read
    returned: every second of training lands in exactly one step, and no evaluation or save
    does (they are timed apart as eval_time_s and save_time_s)."""

    def __init__(self, run: Run, writer: MetricsWriter, progress: Progress, start: int) -> None:
        self.run, self.writer, self.progress = run, writer, progress
        t = run.cfg.training
        self.speed = Throughput(start, t.train_iters)
        self.flops = ModelFlops(run.cfg, run.derived, run.device)
        self.in_a_row = 0
        self.last: dict[str, float] = {}
        self.pending: Optional[tuple[int, DeviceScalars, float]] = None
        self.began = time.perf_counter()  # when the host was free to queue the next step

    def queued(self, iteration: int, scalars: DeviceScalars) -> None:
        """Step `iteration` is queued on the device: record the one before it, whose time ended
        when this one began."""
        previous, self.pending = self.pending, (iteration, scalars, self.began)
        if previous is not None:
            self._record(*previous, ended=self.began)
        self.began = time.perf_counter()

    def flush(self) -> None:
        if self.pending is not None:
            previous, self.pending = self.pending, None
            self._record(*previous, ended=None)
            self.began = time.perf_counter()

    def restart_clock(self) -> None:
        """Evaluation and saving are timed apart from training."""
        beat()  # one finished: the agent's hang_timeout_s counts from here
        self.began = time.perf_counter()

    def _record(
        self, iteration: int, scalars: DeviceScalars, began: float, ended: Optional[float]
    ) -> None:
        run, t = self.run, self.run.cfg.training
        metrics = scalars.read()
        beat()  # a finished step, for the agent's hang_timeout_s
        # A flushed step ends when its read returns: the read waited for the device.
        self.speed.add((time.perf_counter() if ended is None else ended) - began)
        self.last = metrics
        nonfinite = not math.isfinite(metrics["loss"]) or (
            metrics["skipped"] and run.derived.precision != "fp16"
        )
        run.counters["skipped_steps"] += int(metrics.pop("skipped"))
        run.counters["consumed_trained_tokens"] += int(metrics.get("trained_tokens", 0))
        run.counters["nonfinite_steps"] += int(nonfinite)
        self.in_a_row = self.in_a_row + 1 if nonfinite else 0
        if t.max_nonfinite_steps and self.in_a_row >= t.max_nonfinite_steps:
            raise NonFiniteSteps(
                f"{self.in_a_row} steps in a row with a non-finite loss or gradient (iterations "
                f"{iteration - self.in_a_row + 1} to {iteration}); stopping without saving "
                f"({last_saved(run.cfg)}, before them). Lower lr, raise warmup, or resume from "
                "it with another seed"
            )
        self.progress.update(metrics)
        if iteration % run.cfg.logging.log_interval == 0 or iteration == t.train_iters:
            metrics.update(step_metrics(run, iteration, self.speed, self.flops))
            self.progress.log(format_line(iteration, t.train_iters, metrics))
            self.writer.write(iteration, metrics)


def train(
    run: Run, start_iteration: int, writer: MetricsWriter, stop: Optional[StopSignal] = None
) -> dict[str, float]:
    """Train from start_iteration to train_iters, evaluating, logging and saving on schedule.

    Stops early, after saving, at exit_interval or when any rank receives SIGTERM/SIGINT.
    """
    cfg, d = run.cfg, run.derived
    t = cfg.training
    train_done, valid_done = consumed_samples(cfg, d.global_batch, start_iteration)
    data = build_data(run, consumed_train_samples=train_done, consumed_valid_samples=valid_done)
    train_stream, valid_stream = data.train, data.valid
    stop = stop or StopSignal()
    progress = Progress(run, start_iteration)
    records = StepRecords(run, writer, progress, start_iteration)
    iteration = start_iteration
    profiler = StepProfiler(cfg.logging, run.rank, run.device)
    if not t.do_train:
        log.info("do_train=false: evaluating the loaded weights only")
        if valid_stream is not None and t.do_valid:
            eval_loss = evaluate(run, valid_stream, t.eval_iters)
            writer.write(iteration, {"loss": eval_loss}, prefix="valid")
    stopping = None
    while t.do_train and iteration < t.train_iters:
        profiler.step(iteration + 1)
        scalars = train_step(run, train_stream, iteration)
        iteration += 1
        if iteration == start_iteration + 1 and cfg.checkpoint.save:
            run.engine.prepare_save()  # the saves' host staging, allocated in the background
        records.queued(iteration, scalars)
        if valid_stream is not None and t.do_valid and iteration % t.eval_interval == 0:
            records.flush()
            tick = time.perf_counter()
            eval_loss = evaluate(run, valid_stream, t.eval_iters)
            eval_s = time.perf_counter() - tick
            progress.log(f"validation at iter {iteration}: loss {eval_loss:.4f} ({eval_s:.1f} s)")
            valid = {"loss": eval_loss, "eval_time_s": eval_s}
            valid.update({k: v.item() for k, v in objective_metrics(run).items()})
            writer.write(iteration, valid, prefix="valid")
            records.restart_clock()
        stopping = stop.agreed()
        exiting = bool(t.exit_interval) and iteration % t.exit_interval == 0
        saving = should_save(cfg, iteration) or (stopping and cfg.checkpoint.save)
        if saving or stopping or exiting:
            records.flush()
        if saving and not poisoned(records.in_a_row, iteration):
            save(run, iteration, writer)
            records.restart_clock()
        if stopping:
            progress.log(f"stopped by {signal.Signals(stopping).name} at iteration {iteration}")
            break
        if exiting:
            log.info("exit_interval=%d reached at iteration %d", t.exit_interval, iteration)
            break
    records.flush()
    profiler.close()
    progress.close()
    done = iteration >= t.train_iters
    if cfg.checkpoint.save and not should_save(cfg, iteration) and done and not stopping:
        if not poisoned(records.in_a_row, iteration):
            save(run, iteration, writer)
    if t.do_test and data.test is not None and (done or not t.do_train):
        test_loss = evaluate(run, data.test, t.eval_iters)
        writer.write(iteration, {"loss": test_loss}, prefix="test")
        if run.is_logging_rank:
            log.info("test loss %.4f", test_loss)
    return records.last


def step_metrics(
    run: Run, iteration: int, speed: Throughput, flops: ModelFlops
) -> dict[str, float]:
    """Data seen, counters, speed, memory and ETA at a logging step."""
    d, seq = run.derived, run.cfg.model.seq_length
    samples = iteration * d.global_batch
    out = {"consumed_samples": samples, "consumed_tokens": samples * seq, **run.counters}
    if (relaunch := restart()) is not None:
        out["restarts"] = relaunch[0]  # deepy.py's max_restarts relaunches so far
    out.update(speed.take(iteration, d.global_batch, seq, d.world_size))
    out.update(flops.metrics(out["tokens_per_s"]))  # TFLOPS per GPU and MFU
    out.update(memory_metrics(run.device))
    return out


def save(run: Run, iteration: int, writer: MetricsWriter) -> None:
    tick = time.perf_counter()
    # async_save: a previous save still writing is waited for first, and timed apart
    # (`save_wait_s`, part of `save_time_s`): saves closer together than a write takes stall
    # the step for that wait, not for the copy.
    wait_for_saves()
    waited = time.perf_counter() - tick
    if waited >= 1.0:
        log.warning(
            "the checkpoint at iteration %d waited %.1f s for the previous one's background "
            "write: saves come closer together than a write takes (raise checkpoint_factor)",
            iteration,
            waited,
        )
    state = {"consumed_train_samples": iteration * run.derived.global_batch, **run.counters}
    if run.objective is not None:
        state.update(run.objective.checkpoint_state())  # the reference weights, for a resume
    save_checkpoint(run.engine, run.cfg, iteration, state, run.derived.padded_vocab_size)
    took = time.perf_counter() - tick
    writer.write(iteration, {"save_time_s": took, "save_wait_s": waited}, prefix="save")


def run_training(cfg, run: Optional[Run] = None) -> dict[str, float]:
    """The whole job on this rank: build, resume, train; returns the last step's metrics."""
    stop = StopSignal()  # before the slow setup, so a signal during it still ends in a save
    run = run or build_run(cfg)
    state = load_checkpoint(run.engine, cfg) or {}
    start = int(state.get("iteration", 0))
    for name in run.counters:
        run.counters[name] = int(state.get(name, 0))
    if run.objective is not None:
        run.objective.start(run.engine.module, state)
    lg = cfg.logging
    writer = MetricsWriter(
        lg.log_dir, lg.tensorboard_dir, enabled=run.is_logging_rank, start_step=start
    )
    if lg.use_wandb and (run.is_logging_rank or lg.wandb_init_all_ranks):
        # Other ranks' runs (wandb_init_all_ranks) record their own system metrics only.
        wandb_run = start_wandb(cfg)
        if run.is_logging_rank:
            writer.attach_wandb(wandb_run)
    if run.is_logging_rank and lg.log_dir:
        write_config(cfg, f"{lg.log_dir}/config.yml")
    try:
        result = train(run, start, writer, stop)
        wait_for_saves()  # async_save: the last checkpoint is complete before the run ends
        rest()  # leaving (a barrier, the process group's end) is not a hung step
        return result
    finally:
        writer.close()
