"""Expert parallelism on 2 gloo ranks: the all-to-all dispatch gives the single-rank MoE layer's
outputs and, summed over the ranks, its gradients."""

import pytest
import torch
import torch.distributed as dist

from neox.config import ConfigError, derive, load_dict
from neox.model import build_model
from neox.parallel.expert import apply_expert_parallel
from neox.parallel.topology import ProcessGroups, Topology
from tests.parallel.parallel_harness import run_ranks

KEYS = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "moe_router_type": "topk",
    "activation": "swiglu",
}


def _ep_matches_one_rank(rank: int, world: int, keys: dict) -> None:
    cfg = load_dict(keys).model
    dense, split = build_model(cfg, 64, seed=7), build_model(cfg, 64, seed=7)
    apply_expert_parallel(split, ProcessGroups(Topology(1, 1, world)), world)
    torch.manual_seed(rank)  # each rank its own tokens, unevenly routed
    ids = torch.randint(0, 64, (2, 17))
    losses = [m(ids[:, :-1], labels=ids[:, 1:]) for m in (dense, split)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(dense.named_parameters(), split.parameters()):
        # A rank's gradient of another rank's experts is zero; the data-parallel sum (what the
        # engines reduce) is the sum of the single-rank gradients.
        total_a, total_b = a.grad.clone(), b.grad.clone()
        dist.all_reduce(total_a)
        dist.all_reduce(total_b)
        torch.testing.assert_close(total_b, total_a, rtol=1e-5, atol=1e-6, msg=name)
        if name.endswith("mlp.experts.dense_h_to_4h"):
            other = slice(2, 4) if rank == 0 else slice(0, 2)
            assert not b.grad[other].any() and a.grad[other].any()


@pytest.mark.parametrize(
    "extra", [{}, {"moe_type": "deepspeed", "moe_token_dropping": True, "moe_top_k": 1}]
)
def test_expert_parallel_matches_one_rank(extra):
    run_ranks(_ep_matches_one_rank, 2, {**KEYS, **extra})


def test_expert_parallel_size_must_divide_experts_and_data_parallel_size():
    with pytest.raises(ConfigError, match="does not divide moe_num_experts=4"):
        load_dict({**KEYS, "moe_expert_parallel_size": 3})
    cfg = load_dict({**KEYS, "moe_expert_parallel_size": 4})
    with pytest.raises(ConfigError, match="does not divide the data-parallel size 2"):
        derive(cfg, 2)
    assert derive(cfg, 8).data_parallel == 8
