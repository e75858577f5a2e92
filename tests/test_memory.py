"""neox/memory.py against what really runs: autograd's saved tensors and a real DeepSpeed engine.

Activations: every tensor autograd saves in a block's forward, captured with
saved_tensors_hooks, must add up to block_activation_bytes. Model states: a real DeepSpeed
engine on two CPU ranks (ZeRO 0-3, bf16 and fp32) must hold exactly the parameter, master-weight
and optimizer-state bytes the estimate names, and its gradients at their peak in backward.
"""

import json

import pytest
import torch

from neox.config import derive, load_dict
from neox.config.model import ModelConfig
from neox.memory import (
    TrainingShape,
    activation_bytes,
    block_activation_bytes,
    estimate_memory,
    logits_bytes,
    training_shape,
)
from neox.model import build_model
from tests.memory_worker import measure_all, saved_activation_bytes
from tests.parallel.parallel_harness import run_ranks

TINY = dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32)
# Block variants whose saved tensors differ: residual style, rotary, GQA, norms, MLP, kernel.
BLOCKS = {
    "pythia": dict(pos_emb="rotary", rotary_pct=0.25, gpt_j_residual=True),
    "sequential_learned": {},
    "gpt_j_tied": dict(pos_emb="rotary", gpt_j_residual=True, gpt_j_tied=True),
    "llama_gqa": dict(
        pos_emb="rotary", norm="rmsnorm", activation="swiglu", num_kv_heads=2, use_bias_in_mlp=False
    ),
    "llama": dict(pos_emb="rotary", norm="rmsnorm", activation="swiglu"),
    "relu_no_pos": dict(activation="relu", pos_emb="none"),
    "qk_norm": dict(use_qk_layernorm=True, pos_emb="rotary"),
    "materialised_scores": dict(attention_impl="torch", pos_emb="rotary"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", BLOCKS)
def test_block_activations_match_saved_tensors(name, dtype):
    cfg = ModelConfig(**{**TINY, **BLOCKS[name]})
    model = build_model(cfg, 128, seed=0).to(dtype).train()
    batch = 3
    ids = torch.randint(0, 128, (batch, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    measured = saved_activation_bytes(model, ids)
    k = 4 if dtype == torch.float32 else 2
    estimated = block_activation_bytes(cfg, "global", cfg.seq_length, batch, k)
    # Within 2%: the norms' fp32 statistics (a few bytes per row) differ between kernels.
    assert estimated == pytest.approx(measured, rel=0.02), (name, measured, estimated)


@pytest.mark.parametrize("name", ["pythia", "llama_gqa"])
def test_whole_model_activations_and_loss_match_saved_tensors(name):
    """Blocks, final norm and head input, plus the fp32 log-softmax the loss keeps: the saved
    third of LOSS_BYTES_PER_LOGIT (its gradient and the logits' come in backward)."""
    cfg = ModelConfig(**{**TINY, **BLOCKS[name], "num_layers": 2})
    vocab, batch = 256, 2
    model = build_model(cfg, vocab, seed=0).to(torch.bfloat16).train()
    ids = torch.randint(0, vocab, (batch, cfg.seq_length), generator=torch.Generator())
    measured = saved_activation_bytes(model, ids, whole=True)
    shape = TrainingShape(vocab_size=vocab, micro_batch=batch, precision="bf16")
    saved_loss = logits_bytes(cfg, shape) // 3
    estimated = activation_bytes(cfg, shape) + saved_loss
    assert estimated == pytest.approx(measured, rel=0.02), (measured, estimated)


ENGINE_MODEL = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    pos_emb="rotary",
    rotary_pct=0.25,
    gpt_j_residual=True,
    no_weight_tying=True,
    padded_vocab_size=512,
    train_micro_batch_size_per_gpu=2,
    tokenizer_type="CharLevelTokenizer",
)


def engine_configs() -> list[dict]:
    """ZeRO 0-3 in bf16 and fp32; small buckets and no ZeRO-3 persistence, so that partitioning
    shows at this size."""
    flats = []
    for precision in ("bf16", "fp32"):
        for stage in range(4):
            zero = {
                "stage": stage,
                "reduce_bucket_size": 5000,
                "stage3_param_persistence_threshold": 0,
            }
            flat = dict(ENGINE_MODEL, zero_optimization=zero)
            if precision == "bf16":
                flat["bf16"] = {"enabled": True}
            flats.append(flat)
    return flats


@pytest.fixture(scope="module")
def engine_measurements(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "measured.json"
    flats = engine_configs()
    run_ranks(measure_all, 2, flats, str(out))
    return list(zip(flats, json.loads(out.read_text())))


@pytest.mark.slow
def test_model_states_match_deepspeed_engine(engine_measurements):
    """Parameters, fp32 masters and Adam states exactly; gradients at their backward peak."""
    for flat, measured in engine_measurements:
        cfg = load_dict(flat)
        derived = derive(cfg, 2, 512)
        est = estimate_memory(cfg.model, training_shape(cfg, derived, 512))
        case = f"{derived.precision} ZeRO-{flat['zero_optimization']['stage']}: {measured}"
        assert measured["dtype_ok"], case
        assert measured["weights"] == est.weights, case
        assert measured["master_weights"] == est.master_weights, case
        assert measured["optimizer_states"] == est.optimizer_states, case
        # Gradients and the ZeRO buckets they pass through are alive together in backward.
        assert measured["gradients_peak"] == est.gradients + est.buffers, case


def test_training_shape_takes_the_optimizer_type_derive_resolved():
    """gpt-neox's flat optimizer_type: sgd (no `optimizer` section) has no Adam moments."""
    cfg = load_dict({"optimizer_type": "sgd"})
    shape = training_shape(cfg, derive(cfg, 1), 512)
    assert shape.optimizer == "sgd"
    assert estimate_memory(cfg.model, shape).optimizer_states == 0
