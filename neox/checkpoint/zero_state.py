"""A DeepSpeed ZeRO 0-2 checkpoint without model parallelism read as a PlainState: DeepSpeed's
engine's, or neox's flat engine's before checkpoints became state/ alone. The flat engine resumes
it through load_plain, at any data-parallel size, as it resumes its own state/.

The model file (neox/checkpoint/ds_files.py names the files) holds the module's weights, the
engine's counters, the client state and `param_shapes`: per optimizer parameter group, its
parameters' names and shapes in the order they were flattened. Each data-parallel rank's
optimizer file holds its partition of every group: the fp32 master weights
(`single_partition_of_fp32_groups`) and the optimizer's state of that partition. Joined over the
ranks, a group is its parameters back to back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from neox.checkpoint.ds_files import ENGINE_KEYS, mp_file, optim_file
from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.trust import load_file


class ZeroState:
    """`step_dir`'s DeepSpeed files read as a PlainState is (`read`, `scalars`, `client_state`,
    what an engine's load_plain takes). With `weights_only` the weights come from the module
    (the optimizer files are not read and need not exist)."""

    def __init__(self, step_dir: Path, trust: bool = False, weights_only: bool = False) -> None:
        self.dir = Path(step_dir)
        model = load_file(self.dir / mp_file(0), trust)
        if int(model.get("mp_world_size", 1)) != 1:
            raise CheckpointError(
                f"{self.dir} was saved with model parallelism; set finetune: true to load its "
                "weights"
            )
        self.module: dict[str, torch.Tensor] = model["module"]
        self.client_state = {k: v for k, v in model.items() if k not in ENGINE_KEYS}
        self.scalars: dict[str, Any] = {"step": None}
        self.full: dict[str, torch.Tensor] = {}  # "<kind>/<name>" -> the whole tensor
        if weights_only:
            return
        self.scalars.update(
            global_steps=model["global_steps"],
            global_samples=model.get("global_samples", 0),
            skipped_steps=model["skipped_steps"],
            loss_scale=None,
        )
        parts = self._optimizer_parts(int(model.get("dp_world_size", 1)), trust)
        first = parts[0]["base_optimizer_state"]
        shapes = model.get("param_shapes") or []
        if len(shapes) != len(parts[0]["single_partition_of_fp32_groups"]):
            raise CheckpointError(
                f"{self.dir}: its model file names {len(shapes)} parameter groups, its optimizer "
                f"files hold {len(parts[0]['single_partition_of_fp32_groups'])}; it is not a "
                "ZeRO 1/2 checkpoint neox can read: set finetune: true to load its weights"
            )
        kinds = {"fp32": "single_partition_of_fp32_groups"}
        if first["state"]:  # saved after the first step: the moments too
            self.scalars["step"] = float(first["state"][0]["step"])
            kinds.update(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq")
        for i, group in enumerate(shapes):
            numel = sum(torch.Size(s).numel() for s in group.values())
            for kind, key in kinds.items():
                if kind == "fp32":
                    pieces = [p[key][i] for p in parts]
                else:
                    pieces = [p["base_optimizer_state"]["state"][i][key] for p in parts]
                flat = torch.cat([t.reshape(-1).float() for t in pieces])
                if flat.numel() < numel:
                    raise CheckpointError(
                        f"{self.dir}: parameter group {i} holds {flat.numel()} values, its "
                        f"parameters {numel}; the checkpoint is incomplete"
                    )
                offset = 0
                for name, shape in group.items():
                    n = torch.Size(shape).numel()
                    self.full[f"{kind}/{name}"] = flat[offset : offset + n].view(shape)
                    offset += n

    def _optimizer_parts(self, saved_dp: int, trust: bool) -> list[dict[str, Any]]:
        parts = []
        for r in range(saved_dp):
            files = [self.dir / optim_file(r, True), self.dir / optim_file(r, False)]
            found = next((f for f in files if f.is_file()), None)
            if found is None:
                raise CheckpointError(
                    f"{self.dir} holds no ZeRO optimizer file {files[1].name} (dp_world_size "
                    f"{saved_dp}); resume with the ZeRO stage it was saved with, or set "
                    "no_load_optim: true"
                )
            parts.append(load_file(found, trust)["optimizer_state_dict"])
        return parts

    def read(
        self, kind: str, name: str, shape: tuple[int, ...], dim: Optional[int], start: int
    ) -> torch.Tensor:
        """The whole tensor (no model parallelism: dim is None)."""
        key = f"{kind}/{name}"
        if key in self.full:
            value = self.full[key]
        elif kind == "fp32" and name in self.module:
            value = self.module[name].float()
        else:
            raise CheckpointError(
                f"{self.dir} holds no {key}: the checkpoint was saved by another model; resume "
                "with the model config it was saved with"
            )
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.dir}: {name} has shape {tuple(value.shape)}, this model's "
                f"{tuple(shape)}; resume with the model config it was saved with"
            )
        return value
