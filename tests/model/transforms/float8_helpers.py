"""Rank body of tests/model/transforms/test_float8.py: FP8 on tensor-parallel linears (gloo ranks)."""

import json
from pathlib import Path

import torch


def tp_float8(rank: int, world: int, flat: dict, out: str) -> None:
    """Build the tp=world model, apply FP8 (torchao's emulation: CPU has no float8 matmul), run
    forward and backward; rank 0 writes the loss and which parallel linears got float8."""
    from neox.config import load_dict
    from neox.model.transforms.float8 import Float8Matmul, apply_float8
    from neox.parallel.build import parallelize
    from neox.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from neox.parallel.topology import ProcessGroups, Topology

    cfg = load_dict(flat)
    vocab = cfg.tokenizer.padded_vocab_size
    model = parallelize(cfg.model, vocab, ProcessGroups(Topology(world, 1, 1)), seed=5)
    before = model.state_dict()
    converted = apply_float8(
        model, cfg.float8.resolved(), cfg.model.num_layers, "cpu", emulate=True
    )
    ids = torch.randint(
        0, vocab, (2, cfg.model.seq_length), generator=torch.Generator().manual_seed(0)
    )
    positions = torch.arange(cfg.model.seq_length).expand_as(ids)
    loss = model(ids, positions, labels=ids)
    loss.backward()
    float8 = sorted(
        name
        for name, m in model.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
        and isinstance(m.__dict__.get("linear"), Float8Matmul)
    )
    same_state = list(before) == list(model.state_dict()) and all(
        before[k].dtype == v.dtype for k, v in model.state_dict().items()
    )
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                dict(
                    loss=loss.item(),
                    converted=converted,
                    float8=float8,
                    same_state=same_state,
                    float8_head=isinstance(model.head_linear, Float8Matmul),
                    grads=all(p.grad is not None for p in model.parameters()),
                )
            )
        )
