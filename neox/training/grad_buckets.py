"""The flat engine's gradient reduction overlapped with the backward (zero_optimization.overlap_comm).

Each optimizer group's gradient buffer is cut into buckets: contiguous runs of whole parameters
of at most reduce_bucket_size elements (a larger parameter alone), cut from the buffer's end,
where the backward starts, so the bucket left over, and exposed after the backward, is the
first one: the embedding's. The group's trailing padding belongs to its last bucket. During the
backward of a step's last micro batch, a post-accumulate-grad hook on every parameter counts its
bucket down; a bucket whose parameters all hold their gradient is reduced with an asynchronous
collective while the backward goes on.

Collectives are matched by order on every rank (NCCL's rule), and a parameter's gradient may
arrive on one rank and not on another (a parameter unused there). So buckets launch in one fixed
order, the same on every rank: by their earliest parameter in the model, last first (the order
gradients arrive), a bucket only once it and every bucket before it in that order are complete.
At the step the engine launches whatever has not launched (buckets holding a parameter that got
no gradient, and all after them), in the same order, and waits for all.

The collective is an all-reduce of the bucket in place: every rank gets the sum, and reads its
own partition afterwards. The partitions (each rank's contiguous 1/dp of the whole buffer, which
checkpoints are cut by) cut through buckets, so a reduce-scatter of a bucket would not land in
them. One `reduce` per owner of a bucket's pieces (DeepSpeed ZeRO-2's way) would move a
reduce-scatter's bytes, but as a collective per partition a bucket touches, each with its own
root, and leave the other ranks' slices half reduced; one all-reduce moves twice a
reduce-scatter's bytes, behind the backward, and only the last launched is exposed. A group
that fits in one bucket has nothing to hide its collective behind (its bucket completes with the
backward): it keeps the reduce-scatter at the step (FlatGroup.reduce_gradients), as do all
groups where overlaps_reduction says no (overlap_comm off, one rank, another comm dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist


class FlatGroup(Protocol):
    """What the buckets read of the flat engine's FlatGroup (neox/training/flat_engine.py),
    named here so that the engine's module imports this one and not the other way round."""

    params: list[torch.nn.Parameter]
    offsets: list[int]
    grad: torch.Tensor


def bucket_bounds(sizes: Sequence[int], bucket_size: int) -> list[tuple[int, int]]:
    """Each bucket's parameters as index ranges [first, end) into `sizes` (a group's parameters
    in buffer order), in buffer order: runs of whole parameters of at most bucket_size elements
    (a larger one alone), cut from the end."""
    bounds: list[tuple[int, int]] = []
    end, held = len(sizes), 0
    for i in range(len(sizes) - 1, -1, -1):
        if held and held + sizes[i] > bucket_size:
            bounds.append((i + 1, end))
            end, held = i + 1, 0
        held += sizes[i]
    if end:
        bounds.append((0, end))
    return bounds[::-1]


@dataclass
class Bucket:
    """A run of one group's parameters and its slice of the gradient buffer."""

    grad: torch.Tensor
    """The slice of the group's gradient buffer (the last bucket's holds the padding)."""
    params: list[torch.nn.Parameter]
    first: int
    """The position of its earliest parameter in the model: the launch order's key."""
    pending: int = 0
    """Parameters whose gradient has not arrived in this backward."""
    arrived: set[int] = field(default_factory=set)
    """ids of the parameters whose gradient has."""


class GradBuckets:
    """The buckets of the flat engine's groups that have more than one, their hooks, and the
    collectives launched in this step."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        positions: dict[int, int],
        bucket_size: int,
        dp_group: Any,
        armed: Callable[[], bool],
    ) -> None:
        """
        Args:
            positions: each parameter's index in the model's parameters, by id.
            armed: whether a backward now is a step's last micro batch's (the engine's
                is_gradient_accumulation_boundary: step() counts the micro batch after it).
        """
        self.dp_group = dp_group
        self.armed = armed
        self.groups: list[FlatGroup] = []  # those reduced here; the rest at the step
        buckets: list[Bucket] = []
        for g in groups:
            bounds = bucket_bounds([p.numel() for p in g.params], bucket_size)
            if len(bounds) < 2:
                continue
            self.groups.append(g)
            for first, end in bounds:
                lo = g.offsets[first]
                hi = g.offsets[end] if end < len(g.params) else g.grad.numel()
                params = g.params[first:end]
                start = min(positions[id(p)] for p in params)
                buckets.append(Bucket(g.grad[lo:hi], params, start))
        self.buckets = sorted(buckets, key=lambda b: -b.first)
        self.launched = 0
        """Buckets launched in this step, in order: the next to launch is buckets[launched]."""
        self._works: list[Any] = []
        self._handles = []
        for b in self.buckets:
            b.pending = len(b.params)
            for p in b.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(b)))

    def _hook(self, bucket: Bucket) -> Callable[[torch.Tensor], None]:
        def arrived(param: torch.Tensor) -> None:
            if not self.armed():
                return
            if id(param) in bucket.arrived:
                # Autograd accumulates a leaf once a backward, but a reentrant checkpoint runs
                # a backward of its own: a parameter used in two of them comes twice.
                if bucket.pending == 0:
                    raise RuntimeError(
                        f"overlap_comm: a {tuple(param.shape)} parameter got a second gradient in "
                        "one backward after its bucket was reduced (a parameter shared by two "
                        "checkpointed pieces, or a second backward before step()); set "
                        "zero_optimization.overlap_comm: false"
                    )
                return
            bucket.arrived.add(id(param))
            bucket.pending -= 1
            while self.launched < len(self.buckets) and self.buckets[self.launched].pending == 0:
                self._launch()

        return arrived

    def _launch(self) -> None:
        bucket = self.buckets[self.launched]
        bucket.pending = 0  # launched: a late gradient for it is an error
        self._works.append(dist.all_reduce(bucket.grad, group=self.dp_group, async_op=True))
        self.launched += 1

    def finish(self) -> None:
        """Launch the buckets not launched during the backward, in the same order, wait for
        every collective of the step, and rearm for the next."""
        while self.launched < len(self.buckets):
            self._launch()
        for work in self._works:
            work.wait()
        self._works.clear()
        self.launched = 0
        for b in self.buckets:
            b.pending = len(b.params)
            b.arrived.clear()

    def remove(self) -> None:
        """Remove the hooks (the engine's model trains without them afterwards)."""
        for handle in self._handles:
            handle.remove()

    def describe(self) -> str:
        """The buckets in words, for the engine's log line."""
        sizes = [b.grad.numel() for b in self.buckets]
        return f"{len(self.buckets)} buckets of {min(sizes):,}-{max(sizes):,} elements"
