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
No host sync, no per-tensor launches.

The semantics are DeepSpeed's ZeRO-1: bf16 parameters with fp32 master weights partitioned over
the data-parallel ranks (fp32 runs train the parameters themselves), the loss divided by the
accumulation steps, gradients averaged over ranks, clipping by the global norm with DeepSpeed's
formula, a step with an inf/NaN gradient skipped and counted. Checkpoints are DeepSpeed's ZeRO-1
files, key for key: `consolidate`, the export tools and DeepSpeed's engine read them, this
engine resumes DeepSpeed's, and it resumes its own at another data-parallel size.

DeepSpeed keys it honours as DeepSpeed's engine does (the rest send a run to DeepSpeed's, see
neox.plan.engine_choice.FLAT_KEYS): gradient_clipping; fp32_allreduce and
communication_data_type (the dtype gradients are reduced in); data_types.grad_accum_dtype when
it is the training precision; steps_per_print (a `step=, lr=` debug line) and wall_clock_breakdown
(fwd/bwd/step times, DeepSpeed's timers, read at those steps only). ZeRO's bucket sizes,
overlap_comm, contiguous_gradients and reduce_scatter change nothing here: each group's
gradients are one buffer, reduced by one collective.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from neox.checkpoint.ds_files import ENGINE_KEYS, mp_file, optim_file
from neox.checkpoint.trust import load_file
from neox.data.batch import Batch
from neox.plan.engine_choice import one_pass_adamw
from neox.training.engine import LossFn, StepResult, forward_loss, take, weigh_micro_batches

log = logging.getLogger(__name__)

MODEL_FILE = mp_file(0)
# DeepSpeed pads each flat group to 4 bytes of bf16 times the data-parallel size, so that every
# rank's partition starts 4-byte aligned and all partitions are the same size.
ALIGNMENT = 2


COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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

    def slice_mappings(self) -> OrderedDict:
        """DeepSpeed's param_slice_mappings: each parameter's fragment in this partition."""
        from deepspeed.utils.tensor_fragment import fragment_address

        out = OrderedDict()
        end = self.start + self.size
        for name, p, off in zip(self.names, self.params, self.offsets):
            lo, hi = max(off, self.start), min(off + p.numel(), end)
            if lo < hi:
                out[name] = fragment_address(numel=hi - lo, start=lo - self.start)
        return out

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
        ds_config: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        mpu,
        loss_fn: LossFn = forward_loss,
    ) -> None:
        self.config = ds_config
        self.loss_fn = loss_fn
        self.bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.module = model.to(dtype)
        self.mpu = mpu
        self.dp_group = mpu.get_data_parallel_group() if mpu is not None else None
        self.dp = mpu.get_data_parallel_world_size() if mpu is not None else 1
        self.dp_rank = mpu.get_data_parallel_rank() if mpu is not None else 0
        self.grad_accum = int(ds_config.get("gradient_accumulation_steps", 1))
        self.clip = float(ds_config.get("gradient_clipping") or 0.0)
        self.micro_batch = int(ds_config["train_micro_batch_size_per_gpu"])
        self.zero_stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        self.comm_dtype = comm_dtype(ds_config, dtype)
        self.steps_per_print = int(ds_config.get("steps_per_print") or 0)
        self.timers = _timers(bool(ds_config.get("wall_clock_breakdown")))
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
        for g in self.groups:
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

    def save(self, save_dir: str, tag: str, client_state: dict[str, Any]) -> None:
        self.save_checkpoint(save_dir, tag, client_state)

    def load(
        self,
        load_dir: str,
        tag: Optional[str],
        load_optimizer_states: bool,
        load_module_only: bool,
        trust: bool = False,
    ) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        return self.load_checkpoint(
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only,
            trust=trust,
        )

    # -- the training state by plain name (neox/checkpoint/plain_state.py) -------------------

    def layout(self) -> Any:
        from neox.checkpoint.plain_state import Layout

        return Layout("flat", 1, 1, self.dp, self.zero_stage)

    @torch.no_grad()
    def plain_pieces(self) -> tuple[list, dict[str, Any]]:
        """Every parameter's fp32 master and moments, whole, on data-parallel rank 0 (the
        partitions gathered there one kind at a time, each moved to host memory before the
        next), and the engine's scalars."""
        from neox.checkpoint.plain_state import KINDS, Piece

        pieces, step = [], None
        for g in self.groups:
            state = self.optimizer.state.get(g.master, {})
            if "step" in state:
                step = float(state["step"])
            tensors: list[dict[str, torch.Tensor]] = [{} for _ in g.params]
            for kind in KINDS:
                part = g.master if kind == "fp32" else state.get(kind)
                if part is None:
                    continue
                full = self._gathered(part.float())
                if full is None:
                    continue
                # Host copies: an async save writes them while the next steps run.
                full = full.to("cpu", copy=True)
                for mine, p, off in zip(tensors, g.params, g.offsets):
                    mine[kind] = full[off : off + p.numel()].view(p.shape)
            if self.dp_rank == 0:
                for name, p, mine in zip(g.names, g.params, tensors):
                    pieces.append(Piece(name, tuple(p.shape), None, 0, mine))
        return pieces, self._scalars(step)

    def _gathered(self, part: torch.Tensor) -> Optional[torch.Tensor]:
        """Every rank's partition joined, on data-parallel rank 0 (None elsewhere)."""
        if self.dp == 1:
            return part
        root = dist.get_global_rank(self.dp_group, 0) if self.dp_group is not None else 0
        parts = [torch.empty_like(part) for _ in range(self.dp)] if self.dp_rank == 0 else None
        dist.gather(part.contiguous(), parts, dst=root, group=self.dp_group)
        return torch.cat(parts) if parts is not None else None

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

    # -- checkpoints, in DeepSpeed's ZeRO-1 layout -------------------------------------------

    def save_checkpoint(
        self, save_dir: str, tag: str, client_state: dict[str, Any], save_latest: bool = False
    ) -> None:
        """The model file (data-parallel rank 0) and this rank's optimizer partition."""
        import deepspeed
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum

        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        if self.dp_rank == 0:
            state = {
                "module": trainable_state_dict(self.module),
                "buffer_names": [n for n, _ in self.module.named_buffers()],
                "optimizer": None,
                "param_shapes": [
                    OrderedDict((n, p.shape) for n, p in zip(g.names, g.params))
                    for g in self.groups
                ],
                "frozen_param_shapes": None,
                "shared_params": {},
                "frozen_param_fragments": None,
                "lr_scheduler": None,
                "data_sampler": None,
                "random_ltd": None,
                "sparse_tensor_module_names": set(),
                "skipped_steps": self.skipped_steps,
                "global_steps": self.global_steps,
                "global_samples": self.global_samples,
                "dp_world_size": self.dp,
                "mp_world_size": 1,
                "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
                "ds_config": self.config,
                "ds_version": deepspeed.__version__,
                **client_state,
            }
            torch.save(state, path / MODEL_FILE)
        optim = {
            "loss_scaler": LossScaler(scale=1.0),
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": self.clip,
            "base_optimizer_state": self.optimizer.state_dict(),
            # DeepSpeed saves the fp32 partitions without the padding. A clone: torch.save of a
            # view writes its whole storage (for fp32 runs, every rank's flat buffer).
            "single_partition_of_fp32_groups": [
                g.master[: g.size - g.padding].clone() for g in self.groups
            ],
            "zero_stage": ZeroStageEnum.optimizer_states,
            "group_paddings": [g.padding for g in self.groups],
            "param_alignment_paddings": [[0] * len(g.params) for g in self.groups],
            "partition_count": [self.dp] * len(self.groups),
            "ds_version": deepspeed.__version__,
            "param_slice_mappings": [g.slice_mappings() for g in self.groups],
        }
        doc = {"optimizer_state_dict": optim, "ds_config": self.config}
        doc["ds_version"] = deepspeed.__version__
        torch.save(doc, path / optim_file(self.dp_rank, self.bf16))

    @torch.no_grad()
    def load_checkpoint(
        self,
        load_dir: str,
        tag: Optional[str] = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = False,
        load_module_only: bool = False,
        trust: bool = False,
    ) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        """Load a ZeRO 0-2 checkpoint without model parallelism (DeepSpeed's or this engine's,
        at any data-parallel size); returns (path, client state) as DeepSpeed's
        load_checkpoint does, or (None, None) when there is none."""
        if tag is None:
            latest = Path(load_dir) / "latest"
            if not latest.is_file():
                return None, None
            tag = latest.read_text().strip()
        path = Path(load_dir) / tag
        model_file = path / MODEL_FILE
        if not model_file.is_file():
            return None, None
        state = load_file(model_file, trust)
        load_trainable_state_dict(self.module, state["module"], model_file)
        if load_module_only:
            self._masters_from_weights()
            return str(model_file), {k: v for k, v in state.items() if k != "module"}
        self.global_steps = state["global_steps"]
        self.global_samples = state.get("global_samples", 0)
        self._skipped.fill_(state["skipped_steps"])
        if load_optimizer_states:
            self._load_optimizer(path, state, trust)
        else:
            self._masters_from_weights()
        skip = ENGINE_KEYS - ({"optimizer"} if not load_optimizer_states else set())
        return str(model_file), {k: v for k, v in state.items() if k not in skip}

    def _masters_from_weights(self) -> None:
        for g in self.groups:
            if g.master is not g.part:
                g.master.copy_(g.part)

    def _load_optimizer(self, path: Path, state: dict[str, Any], trust: bool) -> None:
        """Every saved rank's partition joined into whole groups, then this rank's partition
        taken: the same code reads a checkpoint of any data-parallel size."""
        from neox.checkpoint.errors import CheckpointError

        saved_dp = int(state.get("dp_world_size", 1))
        if int(state.get("mp_world_size", 1)) != 1:
            raise CheckpointError(
                f"{path} was saved with model parallelism; set finetune: true to load its weights"
            )
        parts = []
        for r in range(saved_dp):
            files = [path / optim_file(r, True), path / optim_file(r, False)]
            found = next((f for f in files if f.is_file()), None)
            if found is None:
                raise CheckpointError(
                    f"{path} holds no ZeRO optimizer file {files[0].name} (dp_world_size "
                    f"{saved_dp}); resume with the ZeRO stage it was saved with, or set "
                    "no_load_optim: true"
                )
            doc = load_file(found, trust)
            parts.append(doc["optimizer_state_dict"])
        mapped = [list(m) for m in parts[0].get("param_slice_mappings", [])]
        if saved_dp == 1 and mapped and mapped != [g.names for g in self.groups]:
            raise CheckpointError(
                f"{path}: its parameter groups do not match this model's; resume with the "
                "model config the checkpoint was saved with, or set finetune: true"
            )
        first = parts[0]["base_optimizer_state"]
        if not first["state"]:  # saved before the first step: nothing but the weights
            self._masters_from_weights()
            return
        if len(first["param_groups"]) != len(self.groups):
            raise CheckpointError(
                f"{path} has {len(first['param_groups'])} optimizer parameter groups, this run "
                f"{len(self.groups)}; resume with the optimizer settings it was saved with"
            )
        groups_state = []
        for i, g in enumerate(self.groups):
            g.master.copy_(self._my_partition(path, parts, i, "master"))
            groups_state.append(
                {
                    "step": first["state"][i]["step"],
                    "exp_avg": self._my_partition(path, parts, i, "exp_avg"),
                    "exp_avg_sq": self._my_partition(path, parts, i, "exp_avg_sq"),
                }
            )
        self.optimizer.load_state_dict(
            {"state": dict(enumerate(groups_state)), "param_groups": first["param_groups"]}
        )
        for group in self.optimizer.param_groups:
            group["fused"] = True  # the saved groups may say otherwise
        for g in self.groups:
            if g.master is not g.part:
                g.part.copy_(g.master)
            g.gather_weights(self.dp_group)

    def _my_partition(self, path: Path, parts: list[dict], i: int, key: str) -> torch.Tensor:
        """Group i's `key` ("master" or a moment) joined over the saved ranks' partitions, then
        cut to this rank's partition (zero-padded)."""
        from neox.checkpoint.errors import CheckpointError

        g = self.groups[i]
        if key == "master":
            pieces = [p["single_partition_of_fp32_groups"][i] for p in parts]
        else:
            pieces = [p["base_optimizer_state"]["state"][i][key] for p in parts]
        full = torch.cat([t.reshape(-1).float() for t in pieces])[: g.numel]
        if full.numel() != g.numel:
            raise CheckpointError(
                f"{path}: parameter group {i} holds {full.numel()} values, this model "
                f"{g.numel}; resume with the model config it was saved with"
            )
        mine = torch.zeros(g.size)
        lo, hi = g.start, min(g.start + g.size, g.numel)
        if hi > lo:
            mine[: hi - lo] = full[lo:hi]
        return mine


def trainable_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict without frozen parameters (LoRA's base: its run reads it from
    lora_base), as DeepSpeed's exclude_frozen_parameters saves it."""
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in module.state_dict().items() if k not in frozen}


def load_trainable_state_dict(module: nn.Module, sd: dict[str, Any], source: Path) -> None:
    """Load `sd` into `module`: every tensor, except frozen parameters, which it may lack."""
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    result = module.load_state_dict(sd, strict=not frozen)
    missing = sorted(set(result.missing_keys) - frozen)
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"{source} does not fit the model: missing {missing[:5]}, unexpected "
            f"{sorted(result.unexpected_keys)[:5]}"
        )


def comm_dtype(ds_config: dict[str, Any], dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients are reduced in: communication_data_type, else fp32 with
    fp32_allreduce, else the gradients' own, as DeepSpeed's engine decides."""
    name = ds_config.get("communication_data_type")
    if name is not None:
        return COMM_DTYPES[name]
    return torch.float32 if ds_config.get("fp32_allreduce") else dtype


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
