"""TP mappings and layers on 2 real gloo ranks vs dense single-rank math on the same numbers."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from neox.parallel.layers import sharded_cross_entropy, vocab_parallel_cross_entropy
from tests.parallel.rank_helpers import run_ranks
from tests.parallel.tp_layer_helpers import check_all_ranks
from tests.parallel.vocab_loss_helpers import check_vocab_parallel_loss
from tests.port_helpers import free_port


@pytest.mark.slow
def test_tensor_parallel_layers_match_dense_on_two_ranks():
    run_ranks(check_all_ranks, 2)


@pytest.mark.slow
def test_vocab_parallel_loss_matches_dense_eager_and_compiled_on_two_ranks():
    """Loss, masked mean and gradients (logits, head weight, hidden states) equal the dense
    F.cross_entropy's; compiled with the head: one graph, no break, no fp32 softmax saved."""
    run_ranks(check_vocab_parallel_loss, 2)


def test_vocab_parallel_cross_entropy_single_rank_is_cross_entropy():
    # A group of one rank takes the plain path; the function must still be F.cross_entropy.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        logits, target = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3))
        want = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
        got = vocab_parallel_cross_entropy(logits, target, dist.group.WORLD)
        torch.testing.assert_close(got.flatten(), want)
        # And the sharded math on one rank (no shortcut, as benchmarks time it) agrees too.
        z = logits.clone().requires_grad_()
        got = sharded_cross_entropy(z, target, dist.group.WORLD)
        torch.testing.assert_close(got.flatten(), want)
        got.sum().backward()
        zr = logits.clone().requires_grad_()
        F.cross_entropy(zr.flatten(0, 1), target.flatten(), reduction="sum").backward()
        torch.testing.assert_close(z.grad, zr.grad)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_attention_forks_the_tensor_parallel_rng_only_when_it_draws(dropout):
    """The fork is a graph break under torch.compile: only attention dropout needs it."""
    from neox.config.model import ModelConfig
    from neox.model import build_model
    from neox.parallel.tensor import use_tensor_parallel_rng

    cfg = ModelConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
        max_position_embeddings=8, attention_dropout=dropout,
    )  # fmt: skip
    model = build_model(cfg, 32, seed=0)
    use_tensor_parallel_rng(model)
    wrapped = ["forward" in vars(m) for m in model.modules() if hasattr(m, "query_key_value")]
    assert wrapped == [dropout > 0]
