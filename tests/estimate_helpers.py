"""Rank body of tests/plan/test_estimate.py: count each rank's parameters in real tp/pp builds."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from tests.memory_helpers import saved_activation_bytes


def count_rank_parameters(rank: int, world: int, models: dict, out: str) -> None:
    """For each model: this rank's parameter count under tp=2 (plain model, apply_tensor_parallel)
    and under tp=2 x pp=2 (to_pipeline), and the bytes the tp=2 blocks save in a forward;
    rank 0 writes every rank's."""

    from neox.config.model import ModelConfig
    from neox.parallel.build import parallelize
    from neox.parallel.distributed import start_deepspeed_comm
    from neox.parallel.topology import ProcessGroups, Topology

    start_deepspeed_comm("gloo")  # PipelineModule asks DeepSpeed's comm
    tp_only = ProcessGroups(Topology(tp=2, pp=1, dp=world // 2))
    tp_pp = ProcessGroups(Topology(tp=2, pp=2, dp=world // 4))
    counts = {}
    for name, fields in models.items():
        cfg = ModelConfig(**fields["model"])
        vocab = fields["vocab"]
        row = {}
        for layout, groups in (("tp2", tp_only), ("tp2pp2", tp_pp)):
            model = parallelize(cfg, vocab, groups, device="cpu")
            row[layout] = sum(p.numel() for p in model.parameters())
            if layout == "tp2":
                # What a tp rank's blocks save for backward (its shards of the activations).
                ids = torch.randint(0, vocab, (2, cfg.seq_length), generator=torch.Generator())
                row["tp2_activations"] = saved_activation_bytes(model, ids)
            row[layout + "_stage"] = groups.topo.coord(rank).pipe
        counts[name] = row
    gathered = [None] * world
    dist.all_gather_object(gathered, counts)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
