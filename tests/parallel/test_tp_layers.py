"""TP mappings and layers on 2 real gloo ranks vs dense single-rank math on the same numbers."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_harness import free_port, run_ranks
from tp_layers_checks import check_all_ranks

from neox.parallel.layers import _VocabParallelCrossEntropy, vocab_parallel_cross_entropy


@pytest.mark.slow
def test_tensor_parallel_layers_match_dense_on_two_ranks():
    run_ranks(check_all_ranks, 2)


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
        # And the sharded autograd function on one rank (no shortcut) agrees too.
        z = logits.clone().requires_grad_()
        got = _VocabParallelCrossEntropy.apply(z, target, dist.group.WORLD)
        torch.testing.assert_close(got.flatten(), want)
        got.sum().backward()
        zr = logits.clone().requires_grad_()
        F.cross_entropy(zr.flatten(0, 1), target.flatten(), reduction="sum").backward()
        torch.testing.assert_close(z.grad, zr.grad)
    finally:
        dist.destroy_process_group()
