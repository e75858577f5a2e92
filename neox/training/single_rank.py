"""neox's own engine for a run on one rank: flat buffers and an optimizer step of a few launches.

With one data-parallel rank and no model parallelism, DeepSpeed's ZeRO machinery has nothing to
partition or reduce, but still costs host work per parameter tensor every step: gradient hooks
and copies into its fp32 partition, a per-tensor norm, a copy back into each bf16 parameter. On
one H100 that host work made neox slower than a plain PyTorch loop. Here every parameter is a
view into one flat buffer per parameter group (and so is every gradient), so a step is: the
gradient norm (one reduction per group), one cast of the gradients to fp32, one fused AdamW
launch per group that also applies the clipping factor and skips the update when the gradients
are not finite, and one copy of the fp32 master weights back into the bf16 buffer. No host sync.

The semantics are DeepSpeed's ZeRO-1 at one rank: bf16 parameters with fp32 master weights
(fp32 runs train the parameters themselves), the loss divided by the accumulation steps,
clipping by the global norm with DeepSpeed's formula, a step with an inf/NaN gradient skipped
and counted. Checkpoints are DeepSpeed's ZeRO-1 files, key for key, so `consolidate`, the
export tools and DeepSpeed's own engine read them, and this engine resumes DeepSpeed's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

log = logging.getLogger(__name__)

MODEL_FILE = "mp_rank_00_model_states.pt"
# DeepSpeed's ZeRO 1/2 engine reserves these checkpoint keys; the rest is the caller's state.
ENGINE_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size")
ENGINE_KEYS += ("data_sampler", "random_ltd", "lr_scheduler", "optimizer")
ALIGNMENT = 2  # DeepSpeed pads each flat group to 4 bytes of bf16 (times the data-parallel size).


def optim_file(bf16: bool) -> str:
    return ("bf16_" if bf16 else "") + "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def unsupported_reason(
    ds_config: dict[str, Any], optimizer: Any, world_size: int, pipeline: bool
) -> Optional[str]:
    """Why this engine cannot run a job (None if it can): it covers one rank, bf16 or fp32,
    torch's Adam/AdamW, ZeRO 0-2 without offload."""
    zero = ds_config.get("zero_optimization", {})
    if world_size != 1 or pipeline:
        return "more than one rank"
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16 (loss scaling)"
    if zero.get("stage", 0) > 2:
        return "ZeRO-3"
    if zero.get("offload_optimizer") or zero.get("offload_param"):
        return "ZeRO offload"
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return f"optimizer {type(optimizer).__name__}"
    if any(g.get("lr_scale", 1.0) != 1.0 for g in optimizer.param_groups):
        return "per-group learning-rate scales"
    return None


def _one_pass_ok(optimizer: torch.optim.Optimizer) -> bool:
    """Can neox.kernels.adamw stand in for this optimizer's step? (AdamW's plain options.)"""
    import importlib.util

    plain = all(not g["amsgrad"] and not g["maximize"] for g in optimizer.param_groups)
    triton = importlib.util.find_spec("triton") is not None
    return triton and plain and isinstance(optimizer, torch.optim.AdamW)


class FlatGroup:
    """One optimizer parameter group: its parameters and gradients as views into flat buffers."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], dtype: torch.dtype) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        numel = sum(p.numel() for p in self.params)
        self.padding = -numel % ALIGNMENT
        device = self.params[0].device
        self.flat = torch.zeros(numel + self.padding, dtype=dtype, device=device)
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
        self.numel = numel
        # fp32 master weights, made from the bf16 values as DeepSpeed makes them.
        self.master = self.flat if dtype == torch.float32 else self.flat.float()

    def slice_mappings(self) -> OrderedDict:
        from deepspeed.utils.tensor_fragment import fragment_address

        return OrderedDict(
            (name, fragment_address(numel=p.numel(), start=off))
            for name, p, off in zip(self.names, self.params, self.offsets)
        )


class SingleRankEngine:
    """The part of DeepSpeed's engine interface neox's loop and checkpoint code use, for one rank."""

    def __init__(
        self, ds_config: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, mpu
    ) -> None:
        self.config = ds_config
        self.bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.module = model.to(dtype)
        self.mpu = mpu
        self.grad_accum = int(ds_config.get("gradient_accumulation_steps", 1))
        self.clip = float(ds_config.get("gradient_clipping") or 0.0)
        self.micro_batch = int(ds_config["train_micro_batch_size_per_gpu"])
        self.zero_stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        names = {id(p): n for n, p in model.named_parameters()}
        self.groups = [
            FlatGroup([(names[id(p)], p) for p in g["params"]], dtype)
            for g in optimizer.param_groups
            if g["params"]
        ]
        options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        device = self.groups[0].flat.device
        fused = device.type == "cuda" or device.type == "cpu"
        self.optimizer = type(optimizer)(
            [dict(o, params=[g.master]) for o, g in zip(options, self.groups)],
            **({"fused": True} if fused else {}),
        )
        for group in self.optimizer.param_groups:
            group["fused"] = True
        self.one_pass = self.bf16 and device.type == "cuda" and _one_pass_ok(self.optimizer)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._skipped = torch.zeros((), device=device)
        self._norm: Optional[torch.Tensor] = None

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

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self._optimizer_step()
        self.global_steps += 1
        self.global_samples += self.micro_batch * self.grad_accum

    @torch.no_grad()
    def _optimizer_step(self) -> None:
        norms = [torch.linalg.vector_norm(g.grad, dtype=torch.float32) for g in self.groups]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        found_inf = (~torch.isfinite(norm)).float()
        # DeepSpeed's clipping: divide by (norm + 1e-6) / clip where that exceeds 1. The fused
        # AdamW divides the gradients by grad_scale itself, and skips the update on found_inf.
        scale = torch.ones((), device=norm.device)
        if self.clip > 0:
            ratio = (norm + 1e-6) / self.clip
            scale = torch.where(ratio > 1, ratio, scale)
        if self.one_pass:
            self._one_pass_step(scale, found_inf)
        else:
            self._torch_step(scale, found_inf)
        self._norm = norm
        self._skipped += found_inf

    def _one_pass_step(self, scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """AdamW of neox.kernels.adamw: each group's update in one pass over its buffers."""
        from neox.kernels.adamw import adamw_step_

        for g, group in zip(self.groups, self.optimizer.param_groups):
            state = self.optimizer.state[g.master]
            if not state:  # as torch's fused AdamW lays its state out, for the checkpoints
                state["step"] = torch.zeros((), dtype=torch.float32, device=g.master.device)
                state["exp_avg"] = torch.zeros_like(g.master)
                state["exp_avg_sq"] = torch.zeros_like(g.master)
            state["step"].add_(1 - found_inf)
            adamw_step_(
                g.flat,
                g.master,
                g.grad,
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
            g.grad.zero_()

    def _torch_step(self, scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """torch's fused AdamW on fp32 gradients, then the master weights copied back."""
        for g in self.groups:
            g.master.grad = g.grad if g.master is g.flat else g.grad.float()
        self.optimizer.grad_scale = scale
        self.optimizer.found_inf = found_inf
        self.optimizer.step()
        for g in self.groups:
            g.master.grad = None
            if g.master is not g.flat:
                g.flat.copy_(g.master)
            g.grad.zero_()

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped)

    def get_global_grad_norm(self) -> Optional[float]:
        return None if self._norm is None else float(self._norm)

    def zero_optimization_stage(self) -> int:
        return self.zero_stage

    def zero_optimization_partition_weights(self) -> bool:
        return False

    # -- checkpoints, in DeepSpeed's ZeRO-1 layout -------------------------------------------

    def save_checkpoint(
        self, save_dir: str, tag: str, client_state: dict[str, Any], save_latest: bool = False
    ) -> None:
        import deepspeed
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum

        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "module": self.module.state_dict(),
            "buffer_names": [n for n, _ in self.module.named_buffers()],
            "optimizer": None,
            "param_shapes": [
                OrderedDict((n, p.shape) for n, p in zip(g.names, g.params)) for g in self.groups
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
            "dp_world_size": 1,
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
            "single_partition_of_fp32_groups": [g.master[: g.numel] for g in self.groups],
            "zero_stage": ZeroStageEnum.optimizer_states,
            "group_paddings": [g.padding for g in self.groups],
            "param_alignment_paddings": [[0] * len(g.params) for g in self.groups],
            "partition_count": [1] * len(self.groups),
            "ds_version": deepspeed.__version__,
            "param_slice_mappings": [g.slice_mappings() for g in self.groups],
        }
        doc = {"optimizer_state_dict": optim, "ds_config": self.config}
        torch.save(dict(doc, ds_version=deepspeed.__version__), path / optim_file(self.bf16))

    @torch.no_grad()
    def load_checkpoint(
        self,
        load_dir: str,
        tag: Optional[str] = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = False,
        load_module_only: bool = False,
    ) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        """Load a ZeRO 0-2 one-rank checkpoint (DeepSpeed's or this engine's); returns
        (path, client state) as DeepSpeed's load_checkpoint does, or (None, None)."""
        if tag is None:
            latest = Path(load_dir) / "latest"
            if not latest.is_file():
                return None, None
            tag = latest.read_text().strip()
        path = Path(load_dir) / tag
        model_file = path / MODEL_FILE
        if not model_file.is_file():
            return None, None
        state = torch.load(model_file, map_location="cpu", weights_only=False)
        self.module.load_state_dict(state["module"], strict=True)
        if load_module_only:
            self._masters_from_weights()
            return str(model_file), {k: v for k, v in state.items() if k != "module"}
        self.global_steps = state["global_steps"]
        self.global_samples = state.get("global_samples", 0)
        self._skipped.fill_(state["skipped_steps"])
        optim = self._read_optimizer_file(path, state) if load_optimizer_states else None
        if optim is None:
            self._masters_from_weights()
        else:
            self.optimizer.load_state_dict(optim["base_optimizer_state"])
            for group in self.optimizer.param_groups:
                group["fused"] = True  # the saved groups may say otherwise
            for g, saved in zip(self.groups, optim["single_partition_of_fp32_groups"]):
                g.master[: g.numel].copy_(saved)
                if g.master is not g.flat:
                    g.flat.copy_(g.master)
        skip = set(ENGINE_KEYS) - ({"optimizer"} if not load_optimizer_states else set())
        return str(model_file), {k: v for k, v in state.items() if k not in skip}

    def _masters_from_weights(self) -> None:
        for g in self.groups:
            if g.master is not g.flat:
                g.master.copy_(g.flat)

    def _read_optimizer_file(self, path: Path, state: dict[str, Any]) -> Optional[dict]:
        """The ZeRO optimizer state of a one-rank checkpoint; a layout this engine cannot use
        (another data-parallel size, ZeRO-0's state inside the model file) is an error."""
        from neox.checkpoint.errors import CheckpointError

        if state.get("dp_world_size", 1) != 1 or state.get("mp_world_size", 1) != 1:
            raise CheckpointError(
                f"{path} was saved by {state.get('dp_world_size')} data-parallel x "
                f"{state.get('mp_world_size')} model-parallel ranks; this one-rank run resumes "
                "only one-rank checkpoints: set finetune: true to load its weights"
            )
        files = [path / optim_file(True), path / optim_file(False)]
        found = next((f for f in files if f.is_file()), None)
        if found is None:
            raise CheckpointError(
                f"{path} holds no ZeRO optimizer file ({files[0].name}); resume it with the "
                "ZeRO stage it was saved with, or set no_load_optim: true"
            )
        optim = torch.load(found, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        mapped = [list(m) for m in optim.get("param_slice_mappings", [])]
        if mapped and mapped != [g.names for g in self.groups]:
            raise CheckpointError(
                f"{found}: its parameter groups do not match this model's; resume with the "
                "model config the checkpoint was saved with, or set finetune: true"
            )
        return optim
