"""LoRA applied from outside: adapters split with their base linear, tp=2 equal to tp=1."""

import pytest
import torch

from neox.config.lora import LoraConfig
from neox.model import build_model
from neox.model.transforms.lora import apply_lora, lora_partition_dim, merge_lora
from neox.plan.estimate import lora_block_parameters
from tests.model.transforms.lora_helpers import CFG, LORA, VOCAB, check_lora_tp
from tests.parallel.rank_helpers import run_ranks


@pytest.mark.parametrize("parallel_residual", [False, True])
def test_lora_at_tp2_equals_tp1(parallel_residual):
    """Loss and every adapter gradient (each rank's shard of it) at tp=2 equal tp=1's, with
    adapters on column- (qkv, gate, h_to_4h) and row-parallel (dense, 4h_to_h) linears; with
    the parallel residual too, whose blocks all-reduce both branches once."""
    run_ranks(check_lora_tp, 2, parallel_residual)


def test_adapters_start_as_the_base_and_merge_exactly():
    model = build_model(CFG, VOCAB, seed=3)
    tokens = torch.randint(0, VOCAB, (2, 16))
    base_logits = model(tokens)
    base_sd = {k: v.clone() for k, v in model.state_dict().items()}
    names = apply_lora(model, LORA, None, seed=3)
    assert len(names) == 5 * CFG.num_layers
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_block = lora_block_parameters(CFG, LORA.lora_rank, LORA.lora_target_modules)
    assert adapters == CFG.num_layers * per_block  # what the memory estimate counts
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())
    torch.testing.assert_close(model(tokens), base_logits)  # B = 0
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    adapters = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    merged = build_model(CFG, VOCAB, seed=3)
    merged.load_state_dict(merge_lora(base_sd, adapters, LORA))
    lora_logits = model(tokens)
    assert (lora_logits - base_logits).abs().max() > 1e-3
    torch.testing.assert_close(merged(tokens), lora_logits, rtol=1e-5, atol=1e-5)


def test_partition_dims_follow_the_base_split():
    assert lora_partition_dim("layers.0.attention.query_key_value.lora_A.weight") is None
    assert lora_partition_dim("layers.0.attention.query_key_value.lora_B.weight") == 0
    assert lora_partition_dim("layers.1.mlp.dense_4h_to_h.lora_A.weight") == 1
    assert lora_partition_dim("layers.1.mlp.dense_4h_to_h.lora_B.weight") is None
    assert lora_partition_dim("layers.1.mlp.dense_4h_to_h.weight") is None


def test_target_names_users_know():
    cfg = LoraConfig(lora_rank=2, lora_target_modules=["qkv", "o_proj", "up_proj", "down_proj"])
    assert cfg.lora_target_modules == ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
    with pytest.raises(ValueError, match="fused query_key_value"):
        LoraConfig(lora_rank=2, lora_target_modules=["q_proj"])
    with pytest.raises(ValueError, match="unknown module 'attn'"):
        LoraConfig(lora_rank=2, lora_target_modules=["attn"])
