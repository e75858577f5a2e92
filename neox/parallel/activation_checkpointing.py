"""Activation checkpointing applied from outside the model, through deepspeed.checkpointing.

DeepSpeed's checkpoint saves and restores the default and the tensor-parallel RNG streams
around the recomputation (so dropout masks repeat) and, with partition_activations, keeps only
this tp rank's 1/tp slice of each saved block input. Under sequence parallelism a block input
already is this rank's 1/tp of the sequence, and different on each tp rank, which DeepSpeed's
partitioning (it all-gathers the slices back as one tensor) cannot hold: it is off there.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from neox.parallel.topology import ProcessGroups


def configure_checkpointing(
    groups: ProcessGroups,
    partition_activations: bool = False,
    options: dict[str, Any] | None = None,
) -> None:
    """Point deepspeed.checkpointing at our groups (DeepSpeed keeps this setting module-wide).

    Args:
        options: the DeepSpeed config's activation_checkpointing section; deepspeed.initialize
            does not pass it on to deepspeed.checkpointing, so it is applied here.
    """
    import deepspeed

    o = options or {}
    partition = o.get("partition_activations", partition_activations)
    deepspeed.checkpointing.configure(
        groups,
        partition_activations=partition and not getattr(groups, "sequence_parallel", False),
        contiguous_checkpointing=o.get("contiguous_memory_optimization"),
        num_checkpoints=o.get("number_checkpoints"),
        checkpoint_in_cpu=o.get("cpu_checkpointing"),
        synchronize=o.get("synchronize_checkpoint_boundary"),
        profile=o.get("profile"),
    )


def checkpoint_blocks(layers: nn.ModuleList, num_layers: int = 1) -> None:
    """Recompute blocks in backward: each run of `num_layers` blocks keeps only its input.

    The first block of each run executes the whole run under one checkpoint; the others then
    pass their input through, so module names and the model's forward loop stay unchanged.
    """
    import deepspeed

    if num_layers < 1:
        raise ValueError(f"checkpoint_num_layers={num_layers} must be >= 1")
    blocks = list(layers)
    for start in range(0, len(blocks), num_layers):
        run = [b.forward for b in blocks[start : start + num_layers]]

        def checkpointed(x, position_ids=None, attention_mask=None, kv_cache=None, run=run):
            # Only x goes through the checkpoint: DeepSpeed's (partitioning) checkpoint wants
            # tensor arguments; position ids and the padding mask need no gradient.
            def run_chunk(h):
                for forward in run:
                    h = forward(h, position_ids, attention_mask, kv_cache)
                return h

            return deepspeed.checkpointing.checkpoint(run_chunk, x)

        blocks[start].forward = checkpointed
        for block in blocks[start + 1 : start + num_layers]:
            block.forward = _pass_through


def _pass_through(x: Any, *_: Any) -> Any:
    return x
