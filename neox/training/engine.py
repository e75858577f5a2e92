"""The one interface the training loop steps with, and the engine a run builds behind it.

`Engine` is what neox/training/loop.py and neox/checkpoint/io.py use: a whole optimizer step
from an iterator of micro-batches (`train_batch`), an evaluation batch, train/eval mode, and
its training state by plain name for checkpoints (`plain_pieces`, `load_plain`). Two implementations: neox's flat engine (neox/training/flat_engine.py) and DeepSpeed's
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
import torch.distributed as dist
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
    trained_tokens: Scalar = None
    """Tokens the loss was averaged over: the loss mask's sum over the whole global batch."""


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

    def load(
        self,
        load_dir: str,
        tag: Optional[str],
        load_optimizer_states: bool,
        load_module_only: bool,
        trust: bool = False,
    ) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        """A checkpoint in DeepSpeed's files (gpt-neox's, DeepSpeed's, neox's before state/):
        (path, client state) of the checkpoint loaded, or (None, None) when there is none.
        Files are read weights-only with neox.checkpoint.trust's allow-list unless `trust`.
        Checkpoints are written, and read where they have it, as state/ (plain_pieces,
        load_plain)."""
        ...

    def partitions_weights(self) -> bool:
        """ZeRO-3: each rank holds a slice of every weight (checkpoints are laid out so)."""
        ...

    def parallel_rank(self) -> tuple[int, int]:
        """(model-parallel rank: pipeline stage x tp + tp rank, data-parallel rank) of this
        rank: whose client state it keeps in a checkpoint."""
        ...

    def layout(self) -> Any:
        """neox.checkpoint.plain_state.Layout: engine, TP, PP, DP and ZeRO stage of this run."""
        ...

    def plain_pieces(self) -> tuple[Callable[[], list], dict[str, Any]]:
        """(pieces, scalars): this rank's part of the training state copied to host memory
        (neox.checkpoint.host_staging, reused save to save) and a function returning it by
        plain parameter name (neox.checkpoint.plain_state.Piece; none on ranks whose part
        another rank writes), called by the writer, in the background under async_save; and
        the optimizer step, counters and loss scale. Every rank calls it (it may be
        collective)."""
        ...

    def prepare_save(self) -> None:
        """Allocate the host staging plain_pieces will copy into, in the background (the loop
        calls it after a saving run's first step)."""
        ...

    def load_plain(self, state: Any, load_optimizer_states: bool) -> None:
        """Set this rank's parameters (and optimizer state) from a PlainState saved at any
        layout."""
        ...


LossFn = Callable[[Any, Batch], torch.Tensor]
"""loss_fn(model, batch): the engine's forward (the engine itself, called like its module) and
one micro-batch to the scalar loss. forward_loss for language modelling; a train_impl's
Objective (neox/training/preference.py) otherwise, chosen once at setup."""


def forward_loss(model: Any, batch: Batch) -> torch.Tensor:
    """The micro-batch's share of the step's loss. The model returns its masked mean itself (so
    the output layer and the loss can run fused); `loss_weight` rescales it to the global one."""
    b = batch
    loss = model(b.tokens, b.position_ids, b.attention_mask, b.labels, b.loss_mask)
    return loss if b.loss_weight is None else loss * b.loss_weight


def take(batches: Iterator[Batch], n: int) -> list[Batch]:
    """The next `n` micro-batches: one step's."""
    return [next(batches) for _ in range(n)]


def weigh_micro_batches(
    batches: list[Batch], group: Any = None, world: Optional[int] = None
) -> torch.Tensor:
    """Make the step's loss the mean over the trained tokens of the whole global batch; returns
    their count (a 0-d float64 device tensor, never read here).

    Each engine averages micro-batch losses: over the accumulation steps (the backward divides
    by them) and over the data-parallel ranks (the gradient all-reduce). A micro-batch with
    c_i trained tokens and masked mean S_i / c_i gets loss_weight c_i * n * dp / N, N the
    count over all micro-batches and ranks, so those averages give sum(S) / N exactly, in loss
    and gradient, however unevenly the mask falls. One all-reduce of one number over `group`
    (the data-parallel group; None: the world); queued on the device, no host sync. Without
    masks every weight is exactly 1.0 and the losses are bit for bit the per-batch means.
    DeepSpeed's engine (every layout: TP, the pipeline's loss_fn, ZeRO) steps so; the flat
    engine reaches the same numbers without this all-reduce (FlatEngine.train_batch).
    """
    counts = torch.stack([b.trained_tokens for b in batches])
    total = counts.sum()
    dp = world if world is not None else dist.get_world_size(group) if dist.is_initialized() else 1
    if dp > 1:
        dist.all_reduce(total, group=group)
    # A global batch with nothing to train gives weights 0 (loss 0), not NaN.
    weights = counts * (len(batches) * dp) / total.clamp(min=1.0)
    for b, w in zip(batches, weights.float()):
        b.loss_weight = w
    return total
