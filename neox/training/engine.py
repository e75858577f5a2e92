"""The one interface the training loop steps with, and the engine a run builds behind it.

`Engine` is what neox/training/loop.py and neox/checkpoint/io.py use: a whole optimizer step
from an iterator of micro-batches (`train_batch`), an evaluation batch, train/eval mode, save
and load. Two implementations: neox's flat engine (neox/training/flat_engine.py) and DeepSpeed's
engine behind `DeepSpeedAdapter` (neox/training/deepspeed_engine.py), which keeps everything
DeepSpeed-specific (pipeline batches, the stage-0 norm and non-finite skip, the fused overflow
check, the fp16 loss scale). Which one runs is decided once, torch-free, by
neox.plan.engine_choice.choose_engine; `build_engine` builds what it names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

import torch
from torch import nn

from neox.data.batch import Batch

log = logging.getLogger(__name__)

Scalar = Union[torch.Tensor, float, bool, None]


@dataclass
class StepResult:
    """One optimizer step's metrics, left where they are (device tensors on the flat engine):
    the loop reads them once the next step is queued (neox.training.metrics.DeviceScalars)."""

    loss: torch.Tensor
    """This rank's mean loss over the step's micro-batches."""
    grad_norm: Scalar
    """The global gradient norm before clipping; NaN or None when not finite."""
    skipped: Scalar
    """Whether the optimizer update was skipped (an inf/NaN gradient, or fp16 overflow)."""
    loss_scale: Scalar = None
    """fp16's current loss scale; None in bf16/fp32."""


class Engine(Protocol):
    """What the loop and the checkpoint code need of an engine."""

    module: nn.Module
    optimizer: Any  # its param_groups carry the learning rate the schedule sets

    def train_batch(self, batches: Iterator[Batch]) -> StepResult:
        """One optimizer step over gradient_accumulation_steps micro-batches from `batches`."""
        ...

    def eval_batch(self, batches: Iterator[Batch]) -> torch.Tensor:
        """Mean loss over gradient_accumulation_steps micro-batches, without gradients."""
        ...

    def train(self, mode: bool = True) -> None: ...

    def eval(self) -> None: ...

    def save(self, save_dir: str, tag: str, client_state: dict[str, Any]) -> None:
        """This rank's files of checkpoint `tag` (DeepSpeed's layout), client_state included."""
        ...

    def load(
        self,
        load_dir: str,
        tag: Optional[str],
        load_optimizer_states: bool,
        load_module_only: bool,
        trust: bool = False,
    ) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        """(path, client state) of the checkpoint loaded, or (None, None) when there is none.
        Files are read weights-only with neox.checkpoint.trust's allow-list unless `trust`."""
        ...

    def partitions_weights(self) -> bool:
        """ZeRO-3: each rank holds a slice of every weight (checkpoints are laid out so)."""
        ...


LossFn = Callable[[Any, Batch], torch.Tensor]
"""loss_fn(model, batch): the engine's forward (the engine itself, called like its module) and
one micro-batch to the scalar loss. forward_loss for language modelling; a train_impl's
Objective (neox/training/preference.py) otherwise, chosen once at setup."""


def forward_loss(model: Any, batch: Batch) -> torch.Tensor:
    """The model returns the loss itself, so the output layer and the loss can run fused."""
    b = batch
    return model(b.tokens, b.position_ids, b.attention_mask, b.labels, b.loss_mask)
