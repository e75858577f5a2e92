"""DeepSpeed's engine behind neox's Engine interface (neox/training/engine.py): everything that
is DeepSpeed's own lives here, so the loop never asks which engine runs.

- Pipeline parallelism: DeepSpeed's PipelineEngine runs the whole step (train_batch over the
  accumulation steps) on micro-batches in its (inputs, labels) form (neox.parallel.pipeline_batch).
- Without ZeRO in fp32, DeepSpeed neither reports a gradient norm nor skips a non-finite step:
  the adapter computes the norm (`stage0_grad_norm`) and drops such a step (`skip_step`).
- ZeRO 1/2 checks for non-finite gradients before every step, tensor by tensor (amax, amin, two
  isfinite, two logical ops, an add: ~7 kernels and their host work per parameter tensor). On one
  H100 at Pythia-410M that host work costs ~50 ms a step, more than a third of the step.
  `fuse_overflow_check` replaces it, on that one optimizer instance, by the same test written
  with one foreach max-abs per dtype: a step with any inf/NaN gradient is still skipped exactly
  as before; only the number of launches changes.
- ZeRO-3 replaces torch.nn.functional.linear with its memory-efficient linear, an
  autograd.Function whose output is written in place (the bias add). torch 2.11's dynamo (the
  GPU image's) routes such an output's gradient to the wrong tensor (pytorch issue 180642, fixed
  in 2.12): compiled blocks trained wrong from the second step on an H100, while CPU CI (torch
  2.13) passed. `route_compiled_linears` keeps DeepSpeed's linear for eager code and gives
  compiled graphs torch's own, whose saved tensors AOTAutograd manages.
- fp16: the dynamic loss scale and DeepSpeed's count of skipped (overflowed) steps.
- wall_clock_breakdown under pipeline parallelism: DeepSpeed 0.19's PipelineEngine starts the
  backward timers itself on every stage but the last, and then its engine's backward hook starts
  them again: `AssertionError: bwd_microstep timer has already been started` at the first
  backward of every stock Pythia config with PP. `time_pipeline_backward_once` keeps the pipe's
  own start/stop and lets the hook time nothing during that pass (docs/compat.md).
- fp32 pipelines at ZeRO stage 0 with clipping: DeepSpeed 0.19 sums the squared gradients of
  the first stage and only the tensor-split ones of later stages, so it clips with the wrong
  norm. `clip_pipeline_fp32_gradients` replaces that clip with one over every stage.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from neox.checkpoint.host_staging import HostStaging
from neox.data.batch import Batch
from neox.training.engine import LossFn, StepResult, forward_loss, take, weigh_micro_batches


class DeepSpeedAdapter:
    """deepspeed.initialize's engine (plain, ZeRO or pipeline) as a neox Engine."""

    def __init__(
        self,
        ds_config: dict[str, Any],
        model: nn.Module,
        optimizer: Any,
        mpu: Any,
        loss_fn: LossFn = forward_loss,
    ) -> None:
        import deepspeed
        from deepspeed.runtime.pipe.engine import PipelineEngine

        self.ds, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, mpu=mpu
        )
        fuse_overflow_check(self.ds.optimizer)
        route_compiled_linears()
        if isinstance(self.ds, PipelineEngine):
            time_pipeline_backward_once(self.ds)
            clip_pipeline_fp32_gradients(self.ds)
        if (ds_config.get("compile") or {}).get("deepcompile"):
            # DeepSpeed's DeepCompile (deepspeed_extra_args: {compile: {deepcompile: true}})
            # compiles the whole module with ZeRO's gathers scheduled in the graph.
            self.ds.compile()
        self.loss_fn = loss_fn
        self.staging = HostStaging()  # checkpoints' host copies, reused save to save
        self.pipeline = isinstance(self.ds, PipelineEngine)
        self.fp16 = self.ds.fp16_enabled()
        self.grad_accum = int(
            ds_config["gradient_accumulation_steps"]
        )  # derive()'s, as DeepSpeed reads it
        # ZeRO and the reduced precisions skip non-finite steps and report the norm themselves.
        self.own_norm = (
            self.ds.zero_optimization_stage() == 0
            and not self.fp16
            and not self.ds.bfloat16_enabled()
        )

    @property
    def module(self) -> nn.Module:
        return self.ds.module

    @property
    def optimizer(self) -> Any:
        return self.ds.optimizer

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    def eval(self) -> None:
        self.ds.eval()

    def train_batch(self, batches: Iterator[Batch]) -> StepResult:
        skipped_before = self.ds.skipped_steps
        grad_norm, skipped = None, False
        step = take(batches, self.grad_accum)
        trained = weigh_micro_batches(step, self._dp_group())
        if self.pipeline:
            loss = self.ds.train_batch(data_iter=_pipeline_batches(step))
        else:
            losses = []
            for micro, batch in enumerate(step):
                loss = self.loss_fn(self.ds, batch)
                self.ds.backward(loss)
                losses.append(loss.detach())
                if micro == self.grad_accum - 1 and self.own_norm:
                    grad_norm = stage0_grad_norm(self.ds)
                    if grad_norm is None:
                        skip_step(self.ds)
                        grad_norm, skipped = math.nan, True
                        continue
                self.ds.step()
            loss = torch.stack(losses).mean()
        skipped = skipped or self.ds.skipped_steps > skipped_before
        if grad_norm is None:
            grad_norm = self.ds.get_global_grad_norm()
        scale = getattr(self.ds.optimizer, "cur_scale", None) if self.fp16 else None
        scale = None if scale is None else float(scale)
        return StepResult(loss, grad_norm, skipped, scale, trained)

    def _dp_group(self) -> Any:
        """The data-parallel group (the pipeline's grid, or the mpu; None: the world)."""
        mpu = self.ds.mpu
        return None if mpu is None else mpu.get_data_parallel_group()

    @torch.no_grad()
    def eval_batch(self, batches: Iterator[Batch]) -> torch.Tensor:
        step = take(batches, self.grad_accum)
        weigh_micro_batches(step, self._dp_group())
        if self.pipeline:
            return self.ds.eval_batch(data_iter=_pipeline_batches(step))
        return torch.stack([self.loss_fn(self.ds, b) for b in step]).mean()

    def load(
        self,
        load_dir: str,
        tag: Optional[str],
        load_optimizer_states: bool,
        load_module_only: bool,
        trust: bool = False,
    ) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        from neox.checkpoint.trust import deepspeed_loads_safely

        # Nothing outside the checkpoint is read (a copy re-laid out for this run has no tag).
        root = Path(load_dir) / tag if tag else Path(load_dir)
        with deepspeed_loads_safely(self.ds, trust, root):
            return self.ds.load_checkpoint(
                load_dir,
                tag=tag,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=False,
                load_module_only=load_module_only,
                # A LoRA checkpoint lacks the frozen base (its run reads it from lora_base).
                load_module_strict=all(p.requires_grad for p in self.ds.module.parameters()),
            )

    # -- the training state by plain name (neox/checkpoint/plain_state.py) -------------------

    def _coords(self) -> tuple[int, int, int, int, int, int]:
        """(tp rank, tp, pipeline stage, pp, data-parallel rank, dp) of this rank."""
        if self.pipeline:
            g = self.ds.grid
            return (
                g.get_slice_parallel_rank(),
                g.get_slice_parallel_world_size(),
                g.get_stage_id(),
                g.get_pipe_parallel_world_size(),
                g.get_data_parallel_rank(),
                g.get_data_parallel_world_size(),
            )
        m = self.ds.mpu
        if m is None:
            return 0, 1, 0, 1, torch.distributed.get_rank(), torch.distributed.get_world_size()
        return (
            m.get_tensor_model_parallel_rank(),
            m.get_tensor_model_parallel_world_size(),
            0,
            1,
            m.get_data_parallel_rank(),
            m.get_data_parallel_world_size(),
        )

    def parallel_rank(self) -> tuple[int, int]:
        tp_rank, tp, stage, _, dp_rank, _ = self._coords()
        return stage * tp + tp_rank, dp_rank

    def layout(self) -> Any:
        from neox.checkpoint.plain_state import Layout

        _, tp, _, pp, _, dp = self._coords()
        return Layout("deepspeed", tp, pp, dp, self.ds.zero_optimization_stage())

    def _plain_params(self, writing: bool) -> Iterator[tuple[str, nn.Parameter]]:
        """(plain model name, parameter) of each trainable parameter of this rank's module; a
        head tied to the embedding on the last pipeline stage only when not `writing`."""
        stage = self._coords()[2]
        for name, p in self.ds.module.named_parameters():
            if not p.requires_grad:
                continue
            if self.pipeline:
                name = pipeline_plain_name(name, len(self.ds.module._layer_specs) - 3)
                if writing and name.startswith(TIED) and stage != 0:
                    continue
                name = name.removeprefix(TIED)
            yield name, p

    def _link_states(self) -> None:
        """Point each parameter's fragment at its optimizer state (DeepSpeed links them lazily, in
        its own step: a pipeline run or a fresh engine may not have yet)."""
        opt, base = self.ds.optimizer, self._base_optimizer()
        if not base.state and self._moments():  # a fresh engine: Adam makes it in its first step
            # ZeRO-3 hands its fp32 partitions to the optimizer only during the step.
            flats = getattr(opt, "fp32_partitioned_groups_flat", None)
            # torch's fused and capturable Adam keep `step` on the parameter's device, the others
            # on the host (as torch.optim.Adam._init_group makes it).
            on_device = base.defaults.get("fused") or base.defaults.get("capturable")
            for p in flats or [p for g in base.param_groups for p in g["params"]]:
                base.state[p] = {
                    "step": torch.zeros(
                        (), dtype=torch.float32, device=p.device if on_device else "cpu"
                    ),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
        link = getattr(opt, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            opt._hp_optimizer_states_linked = False  # linked once, maybe before the state was
            link()

    def _base_optimizer(self) -> Any:
        return getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)

    def _moments(self) -> tuple[str, ...]:
        """The Adam moments this run's optimizer keeps (none for SGD: its momentum is not
        carried by name)."""
        base = self._base_optimizer()
        state = next(iter(base.state.values()), None)
        if state is None:
            return ("exp_avg", "exp_avg_sq") if "betas" in base.param_groups[0] else ()
        return tuple(k for k in ("exp_avg", "exp_avg_sq") if k in state)

    def _get(self, p: nn.Parameter, kind: str) -> Optional[torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
            if kind == "fp32":
                return safe_get_full_fp32_param(p)
            return safe_get_full_optimizer_state(p, kind)
        self._check_own_master(p)
        if kind == "fp32":
            return p.detach().float()
        return self._base_optimizer().state.get(p, {}).get(kind)

    def _check_own_master(self, p: nn.Parameter) -> None:
        """Without ZeRO's or the bf16 optimizer's fp32 copies the parameter is its own master:
        true for fp32 runs only (fp16 at ZeRO-0 keeps its masters elsewhere)."""
        from neox.checkpoint.errors import CheckpointError

        if p.dtype != torch.float32:
            raise CheckpointError(
                f"a {p.dtype} run at ZeRO stage 0 keeps its fp32 master weights where neox "
                "cannot read them by name; use zero_optimization stage 1 or more"
            )

    @torch.no_grad()
    def plain_pieces(self) -> tuple[Callable[[], list], dict[str, Any]]:
        """This rank's part of the fp32 masters and moments copied to host memory (the run's
        reused staging), a function that cuts it into pieces by name (the background writer
        calls it), and the engine's scalars. ZeRO-1/2 and the bf16 optimizer: each rank's own
        flat partitions, one copy per group and kind; ZeRO-3: each parameter's partition on
        this rank; no collective in either. ZeRO-0: each parameter whole, kept on
        data-parallel rank 0."""
        self._link_states()
        kinds = ("fp32", *self._moments())
        partitions = self._own_partitions()
        if partitions is not None:
            return self._partition_pieces(partitions, kinds), self._scalars()
        if self._zero3_ranges() is not None:
            return self._zero3_pieces(kinds), self._scalars()
        return self._gathered_pieces(kinds), self._scalars()

    def _zero3_ranges(self) -> Optional[list[tuple[str, nn.Parameter, int, int]]]:
        """ZeRO-3: (name, parameter, first, end) of the flattened elements this rank's partition
        holds of each parameter it writes (rank r holds [r x size, (r + 1) x size), padded
        past the end, as DeepSpeed partitions); None when any parameter is not ZeRO-3's."""
        from neox.checkpoint.consolidate import partition_dim

        params = list(self._plain_params(writing=True))
        if not params or not all(hasattr(p, "ds_id") for _, p in params):
            return None
        tp_rank = self._coords()[0]
        ranges = []
        for name, p in params:
            if tp_rank != 0 and partition_dim(name) is None:
                continue  # replicated over tensor-parallel ranks: rank 0's
            size = p.ds_tensor.ds_numel
            lo = size * torch.distributed.get_rank(group=p.ds_process_group)
            if lo < p.ds_numel:
                ranges.append((name, p, lo, min(lo + size, p.ds_numel)))
        return ranges

    def _zero3_pieces(self, kinds: tuple[str, ...]) -> Callable[[], list]:
        """ZeRO-3: this rank's partition of each parameter (DeepSpeed's local accessors, no
        collective) copied to host memory; the function cutting their fragments."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        from neox.checkpoint.consolidate import partition_dim
        from neox.checkpoint.plain_state import fragment

        tp_rank, tp, _, _, _, _ = self._coords()
        ranges = self._zero3_ranges() or []
        self.staging.reserve(*self._staging_size(len(kinds)))
        held = []
        for name, p, lo, hi in ranges:
            local = {}
            for kind in kinds:
                if kind == "fp32":
                    t = safe_get_local_fp32_param(p)
                else:
                    t = safe_get_local_optimizer_state(p, kind)
                local[kind] = self.staging.put(t.reshape(-1)[: hi - lo])
            held.append((name, p, lo, hi, local))
        self.staging.wait()

        def pieces() -> list:
            return [
                fragment(n, self._shape(p), lo, hi, t, partition_dim(n), tp_rank, tp)
                for n, p, lo, hi, t in held
            ]

        return pieces

    def _own_partitions(self) -> Optional[list[torch.Tensor]]:
        """ZeRO-1/2's (or the bf16 optimizer's) fp32 partition of each parameter group, when
        every trainable parameter maps into them (DeepSpeed's _hp_mapping); else None."""
        opt = self.ds.optimizer
        flats = getattr(opt, "single_partition_of_fp32_groups", None)
        flats = flats if flats is not None else getattr(opt, "fp32_groups_flat_partition", None)
        if not flats or hasattr(opt, "fp32_partitioned_groups_flat"):
            return None
        if not all(hasattr(p, "_hp_mapping") for _, p in self._plain_params(writing=True)):
            return None
        return list(flats)

    def _partition_pieces(
        self, partitions: list[torch.Tensor], kinds: tuple[str, ...]
    ) -> Callable[[], list]:
        """Host copies of this rank's partitions; the function cutting each parameter's
        fragment in them (tensor-replicated parameters from tensor-parallel rank 0)."""
        from neox.checkpoint.consolidate import partition_dim
        from neox.checkpoint.plain_state import fragment

        tp_rank, tp, _, _, _, _ = self._coords()
        state = self._base_optimizer().state
        flat = [{k: f if k == "fp32" else state[f][k] for k in kinds} for f in partitions]
        self.staging.reserve(*self._staging_size(len(kinds)))
        host = [{k: self.staging.put(t) for k, t in ts.items()} for ts in flat]
        self.staging.wait()
        params = list(self._plain_params(writing=True))

        def pieces() -> list:
            out = []
            for name, p in params:
                owned, dim = p._hp_mapping, partition_dim(name)
                if owned is None or not (tp_rank == 0 or dim is not None):
                    continue
                hp, lp = owned.hp_fragment_address, owned.lp_fragment_address
                held = host[owned.param_group_index]
                mine = {k: t[hp.start : hp.start + hp.numel] for k, t in held.items()}
                lo, hi = lp.start, lp.start + lp.numel
                out.append(fragment(name, self._shape(p), lo, hi, mine, dim, tp_rank, tp))
            return out

        return pieces

    def _gathered_pieces(self, kinds: tuple[str, ...]) -> Callable[[], list]:
        """Each parameter whole (ZeRO-0: its own master, or DeepSpeed's accessors where it has
        no own partitions), copied to host memory on the rank that writes it."""
        from neox.checkpoint.consolidate import partition_dim
        from neox.checkpoint.plain_state import tp_piece

        tp_rank, tp, _, _, _, _ = self._coords()
        params = list(self._plain_params(writing=True))
        writes = self._writes(params)
        self.staging.reserve(*self._staging_size(len(kinds)))
        held = []
        for (name, p), write in zip(params, writes):
            local = {}
            for kind in kinds:
                t = self._get(p, kind)  # collective over the data-parallel group under ZeRO-3
                if t is not None and write:
                    local[kind] = self.staging.put(t.reshape(self._shape(p)))
            if write:
                held.append((name, local))
        self.staging.wait()

        def pieces() -> list:
            return [tp_piece(n, local, partition_dim(n), tp_rank, tp) for n, local in held]

        return pieces

    def _writes(self, params: list[tuple[str, nn.Parameter]]) -> list[bool]:
        """Whether this rank writes each parameter gathered whole: data-parallel rank 0, and
        tensor-parallel rank 0 for tensors the TP layers do not split."""
        from neox.checkpoint.consolidate import partition_dim

        tp_rank, _, _, _, dp_rank, _ = self._coords()
        return [dp_rank == 0 and (tp_rank == 0 or partition_dim(n) is not None) for n, _ in params]

    def prepare_save(self) -> None:
        """Allocate the next save's host staging in the background (after the first step: the
        optimizer's moments exist)."""
        self.staging.prepare(*self._staging_size(len(self._moments()) + 1))

    def _staging_size(self, kinds: int) -> tuple[int, torch.device]:
        """Elements and device of one save's host copies, as plain_pieces takes them: own
        partitions, ZeRO-3 ranges, or whole parameters on the ranks that write them."""
        partitions = self._own_partitions()
        if partitions is not None:
            return kinds * sum(f.numel() for f in partitions), partitions[0].device
        ranges = self._zero3_ranges()
        if ranges is not None:
            return kinds * sum(hi - lo for _, _, lo, hi in ranges), self.ds.device
        params = list(self._plain_params(writing=True))
        written = zip(params, self._writes(params))
        numel = sum(math.prod(self._shape(p)) for (_, p), w in written if w)
        return kinds * numel, self.ds.device

    @staticmethod
    def _shape(p: nn.Parameter) -> tuple[int, ...]:
        return tuple(getattr(p, "ds_shape", p.shape))

    def _scalars(self) -> dict[str, Any]:
        step = None
        for s in self._base_optimizer().state.values():
            if "step" in s:
                step = float(s["step"])
                break
        scaler = getattr(self.ds.optimizer, "loss_scaler", None)
        scale = getattr(scaler, "cur_scale", None) if self.fp16 else None
        return {
            "step": step,
            "global_steps": self.ds.global_steps,
            "global_samples": self.ds.global_samples,
            "skipped_steps": self.ds.skipped_steps,
            "loss_scale": None if scale is None else float(scale),
        }

    @torch.no_grad()
    def load_plain(self, state: Any, load_optimizer_states: bool) -> None:
        """This rank's parameters and optimizer state from a checkpoint's plain state."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        from neox.checkpoint.consolidate import partition_dim

        tp_rank, tp, _, _, _, _ = self._coords()
        step = state.scalars.get("step")
        optim = load_optimizer_states and step is not None
        kinds = ("fp32", *self._moments()) if optim else ("fp32",)
        base = self._base_optimizer()
        self._link_states()
        partitioned = False
        for name, p in self._plain_params(writing=False):
            shape = self._shape(p)
            dim = partition_dim(name) if tp > 1 else None
            start = tp_rank * shape[dim] if dim is not None else 0
            for kind in kinds:
                value = state.read(kind, name, shape, dim, start).to(p.device)
                if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
                    partitioned = True
                    if kind == "fp32":
                        safe_set_full_fp32_param(p, value)
                    else:
                        safe_set_full_optimizer_state(p, value, kind)
                    continue
                self._check_own_master(p)
                if kind == "fp32":
                    p.copy_(value)
                else:
                    base.state.setdefault(p, {})[kind] = value.clone()
        if optim:
            for s in base.state.values():
                if isinstance(s.get("step"), torch.Tensor):
                    s["step"] = torch.full_like(s["step"], step)
                else:
                    s["step"] = torch.tensor(step) if "exp_avg" in s else int(step)
        if partitioned:
            self._masters_to_weights()
        scaler = getattr(self.ds.optimizer, "loss_scaler", None)
        if state.scalars.get("loss_scale") is not None and scaler is not None and self.fp16:
            scaler.cur_scale = state.scalars["loss_scale"]
        self.ds.global_steps = int(state.scalars.get("global_steps", 0))
        self.ds.global_samples = int(state.scalars.get("global_samples", 0))
        self.ds.skipped_steps = int(state.scalars.get("skipped_steps", 0))

    def _masters_to_weights(self) -> None:
        """The module's (half-precision or partitioned) weights from the fp32 masters just set."""
        opt = self.ds.optimizer
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
            for lp, hp in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat):
                lp.data.copy_(hp.data)
        else:  # ZeRO 1/2 and the bf16 optimizer
            opt.update_lp_params()

    def partitions_weights(self) -> bool:
        return self.ds.zero_optimization_partition_weights()

    def destroy(self) -> None:
        self.ds.destroy()


TIED = "!tied "


def pipeline_plain_name(name: str, num_layers: int) -> str:
    """The plain GPTNeoX name of a PipelineModule parameter (its layers: the embedding, blocks
    1..num_layers, the final norm, the head; neox/parallel/pipeline.py); a tied embedding's
    name is prefixed TIED (both ends of the pipeline hold it)."""
    if name.startswith("tied_modules."):
        return TIED + name.split(".", 2)[2]
    index, rest = name.split(".", 1)
    k = int(index)
    return f"layers.{k - 1}.{rest}" if 1 <= k <= num_layers else rest


def time_pipeline_backward_once(engine: Any) -> None:
    """On stages before the last, run the pipeline's backward instruction with the engine's
    hook-side backward timer lists empty: the PipelineEngine already starts and stops those
    timers around the pass, and a second start asserts. Per instance (a copy of the class's
    instruction table); a no-op without wall_clock_breakdown."""
    from deepspeed.runtime.pipe import schedule

    if not engine.wall_clock_breakdown():
        return
    pipe_backward = engine._INSTRUCTION_MAP[schedule.BackwardPass]
    timers = engine.engine_timers

    def backward_pass(self: Any, buffer_id: int) -> None:
        if self.is_last_stage():  # DeepSpeed's plain backward, which times itself once
            return pipe_backward(self, buffer_id)
        kept = timers.backward_timers, timers.backward_inner_timers
        timers.backward_timers, timers.backward_inner_timers = [], []
        try:
            return pipe_backward(self, buffer_id)
        finally:
            timers.backward_timers, timers.backward_inner_timers = kept

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.BackwardPass: backward_pass}


def clip_pipeline_fp32_gradients(engine: Any) -> None:
    """The fp32, ZeRO-0 pipeline's gradient clip with the norm over every stage's gradients:
    each tensor-parallel-replicated gradient counted once (tp rank 0), tensor-split ones on every
    rank, a tied weight's copy on a later stage not again; squares summed over the pipeline x
    tensor group. Per instance; a no-op where DeepSpeed does not take this path."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import is_model_parallel_parameter

    if engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization():
        return
    grid = engine.mpu

    def clip_fp32_gradients() -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        counted = [
            p.grad.detach().float().pow(2).sum()
            for p in params
            if not getattr(p, "ds_pipe_replicated", False)
            and (grid.get_slice_parallel_rank() == 0 or is_model_parallel_parameter(p))
        ]
        device = params[0].grad.device if params else engine.device
        squares = torch.stack(counted).sum() if counted else torch.zeros((), device=device)
        dist.all_reduce(squares, group=grid.get_model_parallel_group())
        norm = squares.sqrt()
        engine._global_grad_norm = norm  # read by the loop after the next step is queued
        coef = (engine.gradient_clipping() / (norm + 1e-6)).clamp(max=1.0)  # no host sync
        for p in params:
            p.grad.detach().mul_(coef)

    engine.clip_fp32_gradients = clip_fp32_gradients


def _pipeline_batches(batches: Iterable[Batch]) -> Iterator:
    """Micro-batches in the (inputs, labels) form DeepSpeed's pipeline engine consumes."""
    from neox.parallel.build import pipeline_batch

    for b in batches:
        yield pipeline_batch(b.tokens, b.labels, b.loss_mask, b.loss_weight)


def stage0_grad_norm(engine: Any) -> Optional[float]:
    """The global gradient norm without ZeRO, where DeepSpeed computes none to report; None
    when it is not finite.

    At the accumulation boundary the gradients are already averaged over data-parallel ranks;
    DeepSpeed's helper sums the tensor-parallel shards once each (replicated ones counted once)
    and reports inf or NaN as -1.
    """
    from deepspeed.runtime.utils import get_flattened_grad_norm

    params = [p for p in engine.module.parameters() if p.grad is not None]
    norm = float(get_flattened_grad_norm(params, mpu=engine.mpu))
    return norm if 0 <= norm < math.inf else None


def skip_step(engine: Any) -> None:
    """Drop a step whose gradients are not finite, keeping DeepSpeed's step counters in line.

    ZeRO and fp16 skip such steps themselves; without them DeepSpeed would apply NaNs. The
    gradients are dropped and the optimizer's update is left out of this one engine.step().
    """
    for p in engine.module.parameters():
        if p.grad is not None:
            p.grad.zero_()  # in place: the clipping inside engine.step() expects gradients
    optimizer = engine.optimizer
    optimizer.step = lambda *args, **kwargs: None  # instance attribute shadows the method
    try:
        engine.step()
    finally:
        del optimizer.step


def fuse_overflow_check(optimizer: Any) -> bool:
    """Swap a ZeRO 1/2 optimizer's serial overflow check for the foreach one; True if swapped."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload:
        return False
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(
        _has_overflow_partitioned_grads, optimizer
    )
    return True


def any_non_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Bool tensor of shape (1,): does any tensor hold an inf or NaN? No host sync."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_dtype[t.dtype].append(t)
    # max |x| of a tensor is inf when it holds an inf and NaN when it holds a NaN.
    bad = [
        ~torch.isfinite(torch.stack(torch._foreach_norm(ts, float("inf")))).all()
        for ts in by_dtype.values()
    ]
    if not bad:
        return torch.zeros(1, dtype=torch.bool)
    return torch.stack(bad).any().reshape(1)


def _has_overflow_partitioned_grads(self: Any) -> torch.Tensor:
    """DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial, in a few launches."""
    from deepspeed.accelerator import get_accelerator

    groups = (self.averaged_gradients[i] for i in range(len(self.bit16_groups)))
    grads = [g for group in groups for g in group if g is not None]
    if not grads:
        return torch.zeros(1, dtype=torch.bool, device=get_accelerator().current_device_name())
    return any_non_finite(grads)


def route_compiled_linears() -> None:
    """Where ZeRO-3 has installed its memory-efficient linear as torch.nn.functional.linear,
    install in its place (process-wide, as DeepSpeed's own replacement is) a linear that is
    DeepSpeed's when eager (torch's would save a view of the gathered weight, keeping it gathered
    until backward) and torch's own inside a compiled graph (see the module docstring)."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import (
        InsertPostInitMethodToModuleSubClasses as ZeroInit,
    )

    torch_linear = getattr(ZeroInit, "linear_bk", None)  # what DeepSpeed replaced
    if F.linear is not zero3_linear_wrap or torch_linear is None:
        return

    def zero3_linear(input, weight, bias=None):
        if torch.compiler.is_compiling():
            return torch_linear(input, weight, bias)
        return zero3_linear_wrap(input, weight, bias)

    F.linear = zero3_linear
