"""Rank-side check of LoRA at tp=2 against the same LoRA model at tp=1 (gloo ranks)."""

import torch

from neox.config.lora import LoraConfig
from neox.config.model import ModelConfig
from neox.model import build_model
from neox.model.transforms.lora import apply_lora, lora_partition_dim
from neox.parallel.build import parallelize
from neox.parallel.layers import shard
from neox.parallel.topology import ProcessGroups, Topology
from neox.plan.estimate import lora_block_parameters

VOCAB = 64
KEYS = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    max_position_embeddings=16,
    activation="swiglu",
    intermediate_size=96,
)
CFG = ModelConfig(**KEYS)
LORA = LoraConfig(
    lora_rank=4,
    lora_alpha=8.0,
    lora_target_modules=["query_key_value", "dense", "gate", "dense_h_to_4h", "dense_4h_to_h"],
)


def _nonzero_b(model: torch.nn.Module, tp: int, rank: int) -> None:
    """B starts at 0, which would hide a wrong B split: give every B seeded full values."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                dim = lora_partition_dim(name)
                full_shape = list(p.shape)
                if dim is not None:
                    full_shape[dim] *= tp
                full = torch.randn(full_shape, generator=g) * 0.1
                p.copy_(full if dim is None else shard(full, dim, rank, tp))


def _loss_and_grads(model, tp: int, rank: int):
    _nonzero_b(model, tp, rank)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    loss = model(tokens, labels=labels, loss_mask=torch.ones(2, 16))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    frozen_grads = [
        n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None
    ]
    assert not frozen_grads, frozen_grads
    return loss.detach(), grads


def check_lora_tp(rank: int, world: int, parallel_residual: bool = False) -> None:
    cfg = ModelConfig(**KEYS, gpt_j_residual=parallel_residual)
    groups = ProcessGroups(Topology(world, 1, 1))
    model = parallelize(cfg, VOCAB, groups, seed=7)
    apply_lora(model, LORA, groups, seed=7)
    # A parallel-residual block reduces its branches once: the row-parallel adapters' outputs
    # join the branches' shares (neox/model/transforms/lora.py).
    assert all(b.mlp.dense_4h_to_h.parallel_output == parallel_residual for b in model.layers)
    # The planner's count of this rank's adapter elements (its memory estimate) is the real one.
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_block = lora_block_parameters(cfg, LORA.lora_rank, LORA.lora_target_modules, world)
    assert adapters == cfg.num_layers * per_block
    loss, grads = _loss_and_grads(model, world, rank)

    dense = build_model(cfg, VOCAB, seed=7)
    apply_lora(dense, LORA, None, seed=7)
    want_loss, want = _loss_and_grads(dense, 1, 0)

    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want.keys() and len(grads) == 2 * 5 * cfg.num_layers
    for name, grad in grads.items():
        dim = lora_partition_dim(name)
        expected = want[name] if dim is None else shard(want[name], dim, rank, world)
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=name)
