"""neox's own engine for data-parallel runs: flat buffers and an optimizer step of a few launches.

Without model parallelism, DeepSpeed's ZeRO machinery costs host work per parameter tensor every
step (gradient hooks and copies into its fp32 partition, a per-tensor norm and overflow check, a
copy back into each bf16 parameter); on one H100 it made neox slower than a plain PyTorch loop.
Here every parameter is a view into one flat buffer per parameter group, and so is every
gradient. A step at the accumulation boundary is, per group: one reduce-scatter of the gradient
buffer (each data-parallel rank owns one contiguous partition, as in ZeRO-1), the partition's
gradient norm (all-reduced), one AdamW pass over the partition (neox.kernels.adamw on GPU: the
clipping factor and the skip of a non-finite step applied inside, the bf16 weights written in
the same pass; torch's fused AdamW elsewhere), and one all-gather of the updated bf16 weights.
No host sync, no per-tensor launches. With overlap_comm (below) the reduce-scatter gives way
to bucketed all-reduces during the backward.

The semantics are DeepSpeed's ZeRO-1: bf16 parameters with fp32 master weights partitioned over
the data-parallel ranks (fp32 runs train the parameters themselves), the loss divided by the
accumulation steps, gradients averaged over ranks, clipping by the global norm with DeepSpeed's
formula, a step with an inf/NaN gradient skipped and counted. Checkpoints are neox's state by
plain name (neox/checkpoint/plain_state.py: plain_pieces, load_plain), which DeepSpeed's engine
resumes too, at any layout; DeepSpeed's ZeRO 0-2 files without model parallelism (DeepSpeed's
engine's, this engine's before state/) are read through neox/checkpoint/zero_state.py.

Its settings are neox's own config (FlatSettings.of), never DeepSpeed's JSON. The DeepSpeed keys
it honours as DeepSpeed's engine does (the rest send a run to DeepSpeed's, see
neox.plan.engine_choice.FLAT_KEYS): gradient_clipping; fp32_allreduce and
communication_data_type (the dtype gradients are reduced in); data_types.grad_accum_dtype when
it is the training precision; steps_per_print (a `step=, lr=` debug line) and wall_clock_breakdown
(fwd/bwd/step times, DeepSpeed's timers, read at those steps only); zero_optimization's
overlap_comm and reduce_bucket_size: the gradients are then reduced in buckets during the
backward of a step's last micro batch, each an all-reduce in place, launched in one order on
every rank (neox/training/grad_buckets.py), where the step's reduce-scatter waited for the whole
backward; the partitions, the norm, AdamW and the all-gather are the same. Only in the
gradients' own dtype and across ranks (neox.plan.engine_choice.overlaps_reduction says why
not). allgather_bucket_size, contiguous_gradients and reduce_scatter change nothing here: the
weights are gathered by one collective a group, the gradients are one buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from neox.checkpoint.host_staging import HostStaging
from neox.data.batch import Batch
from neox.plan.engine_choice import (
    REDUCE_BUCKET_SIZE,
    bucketing,
    comm_dtype,
    one_pass_adamw,
    overlaps_reduction,
)
from neox.training.engine import LossFn, StepResult, forward_loss, take, weigh_micro_batches
from neox.training.grad_buckets import GradBuckets

if TYPE_CHECKING:
    from neox.config import Derived, NeoXConfig

log = logging.getLogger(__name__)

# DeepSpeed pads each flat group to 4 bytes of bf16 times the data-parallel size, so that every
# rank's partition starts 4-byte aligned and all partitions are the same size.
ALIGNMENT = 2


COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class FlatSettings:
    """What the flat engine reads of a run's config (FlatSettings.of)."""

    micro_batch: int
    """Samples per micro-batch on each rank (counted into global_samples)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    clip: float = 0.0
    """Clip the gradient's global norm to this (0: no clipping); gradient_clipping."""
    bf16: bool = False
    """bf16 weights and gradients with fp32 master weights; else fp32 throughout."""
    zero_stage: int = 0
    """The configured ZeRO stage (0-2: the partitions are ZeRO-1's whatever the stage)."""
    comm_dtype: Optional[str] = None
    """The dtype gradients are reduced in ("fp32", "fp16", "bf16"); None: their own."""
    steps_per_print: int = 0
    """A `step=, lr=` debug line (and the wall-clock times) every this many steps; 0: never."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step with DeepSpeed's timers, logged at steps_per_print."""
    overlap_comm: bool = False
    """Reduce the gradients in buckets during the backward of a step's last micro batch
    (zero_optimization.overlap_comm; neox/training/grad_buckets.py)."""
    reduce_bucket_size: int = REDUCE_BUCKET_SIZE
    """Elements of a bucket under overlap_comm, at most (zero_optimization.reduce_bucket_size)."""

    @classmethod
    def of(cls, cfg: NeoXConfig, derived: Derived) -> FlatSettings:
        """The settings of a validated config as DeepSpeed's engine reads them: from the JSON
        neox.config.ds_config builds (deepspeed_extra_args taken last), so the two engines
        cannot read a key differently."""
        from neox.config.ds_config import build_ds_config

        ds = build_ds_config(cfg, derived)
        overlap_comm, reduce_bucket_size = bucketing(ds)
        return cls(
            micro_batch=derived.micro_batch,
            grad_accum=derived.grad_accum,
            clip=float(ds.get("gradient_clipping") or 0.0),
            bf16=derived.precision == "bf16",
            zero_stage=int(ds["zero_optimization"].get("stage", derived.zero_stage)),
            comm_dtype=comm_dtype(ds),
            steps_per_print=int(ds.get("steps_per_print") or 0),
            wall_clock_breakdown=bool(ds.get("wall_clock_breakdown")),
            overlap_comm=overlap_comm,
            reduce_bucket_size=reduce_bucket_size,
        )


def _one_pass_ok(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Can neox.kernels.adamw stand in for this optimizer's step on `device`?"""
    import importlib.util

    groups = optimizer.param_groups
    return importlib.util.find_spec("triton") is not None and one_pass_adamw(
        isinstance(optimizer, torch.optim.AdamW),
        any(g["amsgrad"] for g in groups),
        any(g["maximize"] for g in groups),
        device.type,
    )


class FlatGroup:
    """One optimizer parameter group: parameters and gradients as views into flat buffers, and
    this data-parallel rank's partition of them."""

    def __init__(
        self, named: list[tuple[str, nn.Parameter]], dtype: torch.dtype, dp: int, rank: int
    ) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        padded = -(-self.numel // (ALIGNMENT * dp)) * ALIGNMENT * dp
        device = self.params[0].device
        self.flat = torch.zeros(padded, dtype=dtype, device=device)
        self.grad = torch.zeros_like(self.flat)
        self.offsets: list[int] = []
        offset = 0
        for p in self.params:
            n = p.numel()
            self.flat[offset : offset + n].copy_(p.data.reshape(-1))
            p.data = self.flat[offset : offset + n].view_as(p)
            # Autograd accumulates into an existing .grad in place, so gradients land here.
            p.grad = self.grad[offset : offset + n].view_as(p)
            self.offsets.append(offset)
            offset += n
        self.size = padded // dp  # every rank's partition
        self.start = rank * self.size
        self.rank, self.dp = rank, dp
        # The padding inside this rank's partition (only the last rank's holds any).
        self.padding = max(0, min(self.size, self.start + self.size - self.numel))
        self.part = self.flat[self.start : self.start + self.size]
        self.part_grad = self.grad[self.start : self.start + self.size]
        # fp32 master weights of the partition, made from the bf16 values as DeepSpeed does.
        self.master = self.part if dtype == torch.float32 else self.part.float()

    def reduce_gradients(self, group: Any, dtype: torch.dtype) -> None:
        """Sum the gradient buffer over the data-parallel ranks into this rank's partition,
        communicating in `dtype` (a copy when it is not the gradients' own)."""
        if self.dp == 1:
            return
        grad = self.grad if dtype == self.grad.dtype else self.grad.to(dtype)
        part = grad[self.start : self.start + self.size]
        if grad.is_cuda:
            dist.reduce_scatter_tensor(part, grad, group=group)
        else:  # gloo has no reduce-scatter of one tensor
            dist.all_reduce(grad, group=group)
        if grad is not self.grad:
            self.part_grad.copy_(part)

    def gather_weights(self, group: Any) -> None:
        """Every rank's updated partition into every rank's flat weights."""
        if self.dp == 1:
            return
        if self.flat.is_cuda:
            dist.all_gather_into_tensor(self.flat, self.part, group=group)
        else:
            dist.all_gather(list(self.flat.chunk(self.dp)), self.part.clone(), group=group)


class FlatEngine:
    """neox's Engine (neox/training/engine.py) for data parallelism alone; its forward,
    backward and step are DeepSpeed's engine's, so the two can be compared call for call."""

    def __init__(
        self,
        settings: FlatSettings,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        mpu,
        loss_fn: LossFn = forward_loss,
    ) -> None:
        self.settings = settings
        self.loss_fn = loss_fn
        self.bf16 = settings.bf16
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.module = model.to(dtype)
        self.mpu = mpu
        self.dp_group = mpu.get_data_parallel_group() if mpu is not None else None
        self.dp = mpu.get_data_parallel_world_size() if mpu is not None else 1
        self.dp_rank = mpu.get_data_parallel_rank() if mpu is not None else 0
        self.grad_accum = settings.grad_accum
        self.clip = settings.clip
        self.micro_batch = settings.micro_batch
        self.zero_stage = settings.zero_stage
        self.comm_dtype = COMM_DTYPES[settings.comm_dtype] if settings.comm_dtype else dtype
        self.steps_per_print = settings.steps_per_print
        self.timers = _timers(settings.wall_clock_breakdown)
        if self.dp > 1:
            # Every rank starts from rank 0's weights, as DeepSpeed's engine broadcasts them.
            for p in model.parameters():
                dist.broadcast(p.data, dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
        names = {id(p): n for n, p in model.named_parameters()}
        self.groups = [
            FlatGroup([(names[id(p)], p) for p in g["params"]], dtype, self.dp, self.dp_rank)
            for g in optimizer.param_groups
            if g["params"]
        ]
        options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.optimizer = type(optimizer)(
            [dict(o, params=[g.master]) for o, g in zip(options, self.groups)]
        )
        for group in self.optimizer.param_groups:
            group["fused"] = True  # one launch per group; grad_scale and found_inf are honoured
        self.buckets = self._buckets(settings, model)
        device = self.groups[0].flat.device
        self.one_pass = self.bf16 and _one_pass_ok(self.optimizer, device)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._skipped = torch.zeros((), device=device)
        self._norm: Optional[torch.Tensor] = None
        # train_batch's count of this rank's trained tokens in the step (losses are then sums
        # over tokens); None for DeepSpeed-style backward/step calls, whose losses are means.
        self._step_tokens: Optional[torch.Tensor] = None
        self._trained: Optional[torch.Tensor] = None  # the last step's global count
        self.device = device
        self.staging = HostStaging()  # checkpoints' host copies, reused save to save

    def _buckets(self, settings: FlatSettings, model: nn.Module) -> Optional[GradBuckets]:
        """overlap_comm's buckets, or None where the gradients are reduced at the step."""
        precision = "bf16" if self.bf16 else "fp32"
        dp = self.dp
        why_not = overlaps_reduction(settings.overlap_comm, settings.comm_dtype, precision, dp)
        if why_not is not None:
            log.debug("flat engine: gradients reduced after the backward (%s)", why_not)
            return None
        positions = {id(p): i for i, p in enumerate(model.parameters())}
        size = settings.reduce_bucket_size
        buckets = GradBuckets(
            self.groups, positions, size, self.dp_group, self.is_gradient_accumulation_boundary
        )
        if not buckets.buckets:
            log.debug("flat engine: gradients reduced after the backward (each group one bucket)")
            return None
        log.debug("flat engine: gradients reduced during the backward, %s", buckets.describe())
        return buckets

    # -- forward, backward, step --------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.eval()

    def backward(self, loss: torch.Tensor) -> None:
        # As DeepSpeed: each micro-batch's loss counts 1/accumulation-steps of the step's.
        (loss / self.grad_accum if self.grad_accum > 1 else loss).backward()

    def train_batch(self, batches: Iterator[Batch]) -> StepResult:
        """One optimizer step: forward, backward and step over each of its micro-batches."""
        losses = []
        skipped_before = self._skipped.clone()
        step = take(batches, self.grad_accum)
        # Each micro-batch's loss is its sum over trained tokens (its mean times their count);
        # the step divides the summed gradients by the global count, which travels in the
        # all-reduce of the gradient norm: no collective of its own.
        counts = [b.trained_tokens for b in step]
        for b, count in zip(step, counts):
            b.loss_weight = count.float()
        self._step_tokens = torch.stack(counts).sum()
        try:
            for batch in step:
                with self.timers(FWD):
                    loss = self.loss_fn(self, batch)
                with self.timers(BWD):
                    self.backward(loss)
                with self.timers(STEP):
                    self.step()
                losses.append(loss.detach())
        finally:
            self._step_tokens = None
        trained = self._trained
        # This rank's share of the global mean: the data-parallel mean of it is sum / count.
        loss = torch.stack(losses).sum() * self.dp / trained.clamp(min=1.0)
        return StepResult(loss.float(), self._norm, self._skipped > skipped_before, None, trained)

    @torch.no_grad()
    def eval_batch(self, batches: Iterator[Batch]) -> torch.Tensor:
        step = take(batches, self.grad_accum)
        weigh_micro_batches(step, self.dp_group, self.dp)
        return torch.stack([self.loss_fn(self, b) for b in step]).mean()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self._optimizer_step()
        self.global_steps += 1
        self.global_samples += self.micro_batch * self.grad_accum * self.dp
        if self.steps_per_print and self.global_steps % self.steps_per_print == 0:
            self._report_progress()

    def _report_progress(self) -> None:
        """steps_per_print's line, as DeepSpeed's engine prints it (without the skipped count,
        which lives on the device), and wall_clock_breakdown's times since the last one."""
        if dist.is_initialized() and dist.get_rank() != 0:
            self.timers.reset()
            return
        lr = [g["lr"] for g in self.optimizer.param_groups]
        log.debug("step=%d, lr=%s", self.global_steps, lr)  # the loop's progress line has both
        self.timers.log()

    @torch.no_grad()
    def _optimizer_step(self) -> None:
        bucketed: list = []  # groups whose buckets reduced them during the backward
        if self.buckets is not None:
            self.buckets.finish()
            bucketed = self.buckets.groups
        for g in self.groups:
            if not any(g is b for b in bucketed):
                g.reduce_gradients(self.dp_group, self.comm_dtype)
        # The partitions hold gradient sums over the ranks: the norm of the gradient is the
        # all-reduced sum of squares, square-rooted, over the divisor: dp for mean losses, the
        # step's global trained-token count (over the accumulation steps, which backward
        # divides by) for train_batch's summed ones. One all-reduce carries both.
        squares = torch.stack(
            [torch.linalg.vector_norm(g.part_grad, dtype=torch.float32) ** 2 for g in self.groups]
        ).sum()
        if self._step_tokens is None:
            if self.dp > 1:
                dist.all_reduce(squares, group=self.dp_group)
            divisor = torch.full((), float(self.dp), device=squares.device)
        else:
            both = torch.stack([squares.double(), self._step_tokens.double()])
            if self.dp > 1:
                dist.all_reduce(both, group=self.dp_group)
            squares, self._trained = both[0].float(), both[1]
            divisor = (self._trained.clamp(min=1.0) / self.grad_accum).float()
        norm = squares.sqrt() / divisor
        found_inf = (~torch.isfinite(norm)).float()
        # The sums are divided by the divisor and, as DeepSpeed clips, by (norm + 1e-6) / clip
        # where that exceeds 1: both through the optimizer's grad_scale, which also skips on
        # found_inf.
        scale = divisor
        if self.clip > 0:
            ratio = (norm + 1e-6) / self.clip
            scale = torch.where(ratio > 1, ratio * divisor, scale)
        if self.one_pass:
            self._one_pass_step(scale, found_inf)
        else:
            self._torch_step(scale, found_inf)
        for g in self.groups:
            g.gather_weights(self.dp_group)
            g.grad.zero_()
        self._norm = norm
        self._skipped += found_inf

    def _one_pass_step(self, scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """AdamW of neox.kernels.adamw: each partition's update in one pass over its buffers."""
        from neox.kernels.adamw import adamw_step_

        for g, group in zip(self.groups, self.optimizer.param_groups):
            state = self.optimizer.state[g.master]
            if not state:  # as torch's fused AdamW lays its state out, for the checkpoints
                state["step"] = torch.zeros((), dtype=torch.float32, device=g.master.device)
                state["exp_avg"] = torch.zeros_like(g.master)
                state["exp_avg_sq"] = torch.zeros_like(g.master)
            state["step"].add_(1 - found_inf)
            adamw_step_(
                g.part,
                g.master,
                g.part_grad,
                state["exp_avg"],
                state["exp_avg_sq"],
                state["step"],
                scale,
                found_inf,
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )

    def _torch_step(self, scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """torch's fused AdamW on fp32 gradients, then the master weights copied back."""
        for g in self.groups:
            g.master.grad = g.part_grad if g.master is g.part else g.part_grad.float()
        self.optimizer.grad_scale = scale
        self.optimizer.found_inf = found_inf
        self.optimizer.step()
        for g in self.groups:
            g.master.grad = None
            if g.master is not g.part:
                g.part.copy_(g.master)

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped)

    @property
    def skipped_steps_tensor(self) -> torch.Tensor:
        """skipped_steps as a 0-d device tensor (reading it would wait for the device)."""
        return self._skipped

    def get_global_grad_norm(self) -> Optional[torch.Tensor]:
        """The last step's norm as a 0-d device tensor (reading it would wait for the device)."""
        return self._norm

    def zero_optimization_stage(self) -> int:
        return self.zero_stage

    def partitions_weights(self) -> bool:
        return False

    def load(
        self,
        load_dir: str,
        tag: Optional[str],
        load_optimizer_states: bool,
        load_module_only: bool,
        trust: bool = False,
    ) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        """A checkpoint in DeepSpeed's ZeRO 0-2 files without model parallelism (DeepSpeed's
        engine's, or this engine's before state/), at any data-parallel size, through
        load_plain; (None, None) when there is none."""
        from neox.checkpoint.ds_files import mp_file
        from neox.checkpoint.find import read_latest
        from neox.checkpoint.zero_state import ZeroState

        tag = tag or read_latest(Path(load_dir))
        path = Path(load_dir) / (tag or "")
        if tag is None or not (path / mp_file(0)).is_file():
            return None, None
        state = ZeroState(path, trust, weights_only=load_module_only)
        self.load_plain(state, load_optimizer_states and not load_module_only)
        return str(path / mp_file(0)), state.client_state

    def parallel_rank(self) -> tuple[int, int]:
        return 0, self.dp_rank

    # -- the training state by plain name (neox/checkpoint/plain_state.py) -------------------

    def layout(self) -> Any:
        from neox.checkpoint.plain_state import Layout

        return Layout("flat", 1, 1, self.dp, self.zero_stage)

    @torch.no_grad()
    def plain_pieces(self) -> tuple[Callable[[], list], dict[str, Any]]:
        """This rank's partitions of the fp32 masters and moments copied to host memory (one
        copy each, into the run's reused staging), a function that cuts them into pieces by
        name (each parameter's part in this partition: the background writer calls it), and
        the engine's scalars. No collective: every data-parallel rank writes what it owns."""
        from neox.checkpoint.plain_state import fragment

        parts = self._saved_partitions()
        self.staging.reserve(_numel(parts), self.device)
        host = [(g, {k: self.staging.put(t) for k, t in ts.items()}) for g, ts in parts]
        self.staging.wait()

        def pieces() -> list:
            out = []
            for g, held in host:
                for name, p, off in zip(g.names, g.params, g.offsets):
                    lo, hi = max(off, g.start), min(off + p.numel(), g.start + g.size)
                    if lo < hi:
                        mine = {k: t[lo - g.start : hi - g.start] for k, t in held.items()}
                        out.append(fragment(name, tuple(p.shape), lo - off, hi - off, mine))
            return out

        steps = [self.optimizer.state.get(g.master, {}).get("step") for g in self.groups]
        step = next((float(s) for s in reversed(steps) if s is not None), None)
        return pieces, self._scalars(step)

    def _saved_partitions(self) -> list[tuple[FlatGroup, dict[str, torch.Tensor]]]:
        """Each group with this rank's partition of every kind a checkpoint keeps (the moments
        once the optimizer has made them)."""
        from neox.checkpoint.plain_state import KINDS

        parts = []
        for g in self.groups:
            state = self.optimizer.state.get(g.master, {})
            kinds = {k: g.master if k == "fp32" else state.get(k) for k in KINDS}
            parts.append((g, {k: t for k, t in kinds.items() if t is not None}))
        return parts

    def prepare_save(self) -> None:
        """Allocate the next save's host staging in the background (after the first step: the
        moments exist)."""
        self.staging.prepare(_numel(self._saved_partitions()), self.device)

    def _scalars(self, step: Optional[float]) -> dict[str, Any]:
        return {
            "step": step,
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "loss_scale": None,
        }

    @torch.no_grad()
    def load_plain(self, state: Any, load_optimizer_states: bool) -> None:
        """This rank's partitions from a checkpoint's plain state (any layout saved it)."""
        step = state.scalars.get("step")
        optim = load_optimizer_states and step is not None
        for g in self.groups:
            mine = {}
            for kind in ("fp32", "exp_avg", "exp_avg_sq") if optim else ("fp32",):
                part = torch.zeros(g.size, dtype=torch.float32)
                for name, p, off in zip(g.names, g.params, g.offsets):
                    lo, hi = max(off, g.start), min(off + p.numel(), g.start + g.size)
                    if lo < hi:
                        full = state.read(kind, name, tuple(p.shape), None, 0).reshape(-1)
                        part[lo - g.start : hi - g.start] = full[lo - off : hi - off]
                mine[kind] = part.to(g.master.device)
            g.master.copy_(mine.pop("fp32"))
            if optim:
                step_t = torch.tensor(float(step), dtype=torch.float32, device=g.master.device)
                self.optimizer.state[g.master] = {"step": step_t, **mine}
            if g.master is not g.part:
                g.part.copy_(g.master)
            g.gather_weights(self.dp_group)
        self.global_steps = int(state.scalars.get("global_steps", 0))
        self.global_samples = int(state.scalars.get("global_samples", 0))
        self._skipped.fill_(int(state.scalars.get("skipped_steps", 0)))


FWD, BWD, STEP = "fwd", "bwd", "step"  # DeepSpeed's global timer names


class _Timers:
    """wall_clock_breakdown's timers: DeepSpeed's own (device events, read only when logged)."""

    def __init__(self) -> None:
        from deepspeed.utils.timer import SynchronizedWallClockTimer

        self.timers = SynchronizedWallClockTimer()

    @contextmanager
    def __call__(self, name: str):
        self.timers(name).start()
        try:
            yield
        finally:
            self.timers(name).stop()

    def log(self) -> None:
        self.timers.log([FWD, BWD, STEP])

    def reset(self) -> None:
        # elapsed(reset=True) keeps a running timer running (reset() would stop the step's own
        # timer, which steps_per_print's report on ranks other than 0 runs inside of).
        for name in (FWD, BWD, STEP):
            self.timers(name).elapsed(reset=True)


class _NoTimers:
    @contextmanager
    def __call__(self, name: str):
        yield

    def log(self) -> None:
        pass

    def reset(self) -> None:
        pass


def _timers(enabled: bool) -> Any:
    return _Timers() if enabled else _NoTimers()


def _numel(parts: list[tuple[Any, dict[str, torch.Tensor]]]) -> int:
    """Elements of a save's host copies (FlatEngine._saved_partitions)."""
    return sum(t.numel() for _, ts in parts for t in ts.values())
