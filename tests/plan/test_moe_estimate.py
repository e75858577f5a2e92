"""The estimate of an MoE model: total and active parameters against the built model, expert
weights per rank, all-to-all traffic, and the report's lines."""

import pytest
import torch

from neox.config import derive, load_dict
from neox.model import build_model
from neox.plan.estimate import (
    active_parameters,
    all_to_all_bytes,
    count_parameters,
    expected_ranks,
    expert_parameters,
    flops_parameters,
)
from neox.plan.report import estimate_report

BASE = {"num_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "moe_num_experts": 4}


@pytest.mark.parametrize(
    "keys",
    [
        {"moe_top_k": 2},
        {"moe_expert_interval": 2, "activation": "swiglu", "moe_ffn_hidden_size": 24},
        {"moe_num_shared_experts": 2, "moe_top_k": 1, "use_bias_in_mlp": False},
    ],
)
def test_counts_match_the_built_model(keys):
    cfg = load_dict({**BASE, **keys}).model
    params = dict(build_model(cfg, 128).named_parameters())
    assert count_parameters(cfg, 128) == sum(p.numel() for p in params.values())
    experts = {n: p.numel() for n, p in params.items() if ".mlp.experts." in n}
    assert expert_parameters(cfg) == sum(experts.values())
    assert expert_parameters(cfg, ep=2) == sum(experts.values()) // 2
    # A token uses top_k of the E experts' weights, everything else whole.
    idle = sum(experts.values()) * (4 - cfg.moe_top_k) // 4
    assert active_parameters(cfg, 128) == count_parameters(cfg, 128) - idle
    # FLOPs count the active matrices (the output layer once, no embedding lookup, no biases).
    assert flops_parameters(cfg, 128) < active_parameters(cfg, 128) + 128 * 32


def test_all_to_all_traffic():
    cfg = load_dict({**BASE, "moe_top_k": 2}).model
    assert all_to_all_bytes(cfg, tokens=1024, ep=1, element_bytes=2) == 0
    # A token's 2 of 4 experts both on one rank of 2 (2 experts each): 2 of the 6 pairs. So
    # 1 + 4/6 ranks a token, 5/6 of a row leaving the rank; 3 MoE layers x 4 transfers x
    # 1024 tokens x 32 features x 2 bytes.
    assert expected_ranks(cfg, 2) == pytest.approx(5 / 3)
    assert all_to_all_bytes(cfg, 1024, ep=2, element_bytes=2) == round(3 * 4 * 1024 * 5 / 6 * 64)
    # Top-1: one row a token, the 1 / ep on its own rank staying.
    top1 = load_dict({**BASE, "moe_top_k": 1}).model
    assert all_to_all_bytes(top1, 1024, ep=4, element_bytes=2) == 3 * 4 * 1024 * 64 * 3 // 4


@pytest.mark.parametrize("experts,k,ep", [(64, 8, 4), (8, 2, 4), (8, 4, 2), (128, 8, 8)])
def test_expected_ranks_against_uniform_routing(experts, k, ep):
    """The formula against the distinct ranks of k distinct experts drawn uniformly."""
    cfg = load_dict({**BASE, "moe_num_experts": experts, "moe_top_k": k}).model
    g = torch.Generator().manual_seed(0)
    choices = torch.rand(20_000, experts, generator=g).topk(k, dim=-1).indices
    ranks = torch.zeros(20_000, ep).scatter_(1, choices // (experts // ep), 1).sum(1)
    assert expected_ranks(cfg, ep) == pytest.approx(ranks.mean().item(), rel=0.01)
    assert expected_ranks(cfg, 1) == 1


def test_report_names_active_parameters_and_expert_memory():
    cfg = load_dict({**BASE, "moe_top_k": 2, "seq_length": 64})
    text = estimate_report(cfg, derive(cfg, 8, 128), 128)
    assert f"{active_parameters(cfg.model, 128):,} active parameters per token" in text
    assert f"experts per rank: {expert_parameters(cfg.model):,} parameters" in text
    dense = load_dict({k: v for k, v in BASE.items() if k != "moe_num_experts"})
    assert "MoE" not in estimate_report(dense, derive(dense, 8, 128), 128)
