"""neox/plan/memory.py against what really runs: autograd's saved tensors and the real engines.

Activations: every tensor autograd saves in a block's forward, captured with
saved_tensors_hooks, must add up to block_activation_bytes. Model states: the engine
build_engine picks on two CPU ranks (DeepSpeed's at ZeRO 0-3, neox's flat engine at ZeRO 0-1,
bf16 and fp32) must hold exactly the parameter, master-weight and optimizer-state bytes the
estimate names, and its gradients at their peak in backward; so must the flat engine on one.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from neox.config import derive, load_dict
from neox.config.model import ModelConfig
from neox.model import build_model
from neox.plan.memory import (
    FLAT_ALIGNMENT,
    TrainingShape,
    activation_bytes,
    block_activation_bytes,
    estimate_memory,
    logits_bytes,
    norm_activation_bytes,
    training_shape,
)
from tests.memory_helpers import measure_all, saved_activation_bytes
from tests.parallel.rank_helpers import run_ranks

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [0, 64, 1000], ids=["eager", "chunked", "one_chunk"])
def test_loss_peak_matches_tracked_memory(chunk, dtype):
    """The eager and the chunked loss from the final hidden states, forward and backward on CPU:
    the most activation and temporary bytes alive at once, as torch's MemTracker follows every
    storage, against logits_bytes plus the head's saved inputs. (The compiled loss's graph keeps
    the logits in the compute dtype: measured on a GPU, docs/benchmarks.md.)"""
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = ModelConfig(**{**TINY, "seq_length": 64, "lm_loss_chunk_size": chunk})
    vocab, batch, k = 4096, 4, 4 if dtype == torch.float32 else 2
    model = build_model(cfg, vocab, seed=0).to(dtype)
    x = torch.randn(batch, cfg.seq_length, cfg.hidden_size, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, cfg.seq_length), generator=torch.Generator())
    model.loss(x, labels).backward()  # gradients exist, as after the first step
    tracker = MemTracker()
    tracker.track_external(model, x)
    with tracker:
        model.loss(x, labels).backward()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    measured = sum(
        v for key, v in peak.items() if getattr(key, "value", "") in ("Activation", "Temp")
    )
    precision = "fp32" if k == 4 else "bf16"
    shape = TrainingShape(vocab_size=vocab, micro_batch=batch, precision=precision)
    shape = replace(shape, loss="chunked" if chunk else "eager", loss_chunk=chunk)
    shared, own = norm_activation_bytes(cfg, k, cfg.hidden_size)
    head = batch * cfg.seq_length * (shared + own + k * cfg.hidden_size)
    assert logits_bytes(cfg, shape) + head == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_loss_saves_the_logits_in_the_compute_dtype(dtype):
    """compile_blocks' graph of final norm, output layer and loss saves for backward the logits
    in the compute dtype and fp32 row statistics (no fp32 log-softmax), beside the head's
    inputs. aot_eager_decomp_partition partitions the graph as inductor does, without
    generating code; inductor's backward then writes the logits' gradient into their buffer."""
    from neox.parallel.build import compile_blocks

    cfg = ModelConfig(**{**TINY, "seq_length": 64})
    vocab, batch, k = 4096, 4, 4 if dtype == torch.float32 else 2
    model = build_model(cfg, vocab, seed=0).to(dtype)
    compile_blocks(model, backend="aot_eager_decomp_partition")
    x = torch.randn(batch, cfg.seq_length, cfg.hidden_size, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, cfg.seq_length), generator=torch.Generator())
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(x, labels).backward()
    tokens = batch * cfg.seq_length
    shared, own = norm_activation_bytes(cfg, k, cfg.hidden_size)
    head = tokens * (shared + own + k * cfg.hidden_size)
    precision = "fp32" if k == 4 else "bf16"
    shape = TrainingShape(vocab_size=vocab, micro_batch=batch, precision=precision)
    shape = replace(shape, loss="compiled")
    # The estimate also charges what the backward allocates beside the logits' gradient: the
    # head weight's and the hidden states' gradients (not saved tensors).
    grads = k * (tokens + vocab) * cfg.hidden_size
    assert head + logits_bytes(cfg, shape) - grads == pytest.approx(sum(seen.values()), rel=0.02)


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


# scalenorm's one-element gains make the group of biases and norms odd-sized, so that the flat
# engine's padding shows.
FLAT_MODEL = dict(ENGINE_MODEL, norm="scalenorm")


def engine_configs() -> list[dict]:
    """DeepSpeed's engine at ZeRO 0-3 and the flat engine at ZeRO 0-1, in bf16 and fp32; small
    buckets and no ZeRO-3 persistence, so that partitioning shows at this size."""
    flats = []
    for precision in ("bf16", "fp32"):
        for stage in range(4):
            zero = {
                "stage": stage,
                "reduce_bucket_size": 5000,
                "stage3_param_persistence_threshold": 0,
            }
            cases = [dict(ENGINE_MODEL, zero_optimization=zero, flat_engine=False)]
            if stage < 2:
                cases.append(dict(FLAT_MODEL, zero_optimization=zero))
            for flat in cases:
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
        shape = training_shape(cfg, derived, 512, device="cpu")
        est = estimate_memory(cfg.model, shape)
        case = f"{derived.precision} ZeRO-{flat['zero_optimization']['stage']}: {measured}"
        assert measured["engine"] == ("FlatEngine" if shape.engine == "flat" else "DeepSpeedEngine")
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


def test_activation_memory_budget_scales_what_blocks_keep_beyond_their_input():
    """Compiled on a GPU, a budget keeps its fraction of each block's activations beyond the
    block input; uncompiled (CPU ranks) it changes nothing."""
    flat = {**TINY, "num_layers": 4, "seq_length": 256, "max_position_embeddings": 256}
    est = {}
    for budget in (1.0, 0.5, 0.0):
        cfg = load_dict({**flat, "activation_memory_budget": budget})
        gpu = training_shape(cfg, derive(cfg, 1), 512, device="cuda")
        cpu = training_shape(cfg, derive(cfg, 1), 512, device="cpu")
        est[budget] = activation_bytes(cfg.model, gpu)
        assert activation_bytes(cfg.model, cpu) == activation_bytes(
            cfg.model, replace(gpu, activation_memory_budget=1.0)
        )
    inputs = 4 * 256 * 64 * 4  # layers x tokens x hidden x fp32 bytes: kept at any budget
    head = est[1.0] - 4 * block_activation_bytes(cfg.model, "global", 256, 1, 4)
    assert est[0.0] == inputs + head
    assert est[0.5] - est[0.0] == pytest.approx((est[1.0] - est[0.0]) / 2, abs=4)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_flat_engine_buffers_match_estimate_on_one_rank(precision):
    """The flat engine after a step, in process: its weight, gradient, master and moment
    buffers byte for byte, and the step's fp32 gradient copy it makes on CPU."""
    from neox.training import flat_engine
    from neox.training.flat_engine import FlatEngine, FlatSettings
    from neox.training.optim import build_optimizer

    flat = dict(FLAT_MODEL, zero_optimization={"stage": 1})
    if precision == "bf16":
        flat["bf16"] = {"enabled": True}
    cfg = load_dict(flat)
    derived = derive(cfg, 1, 512)
    shape = training_shape(cfg, derived, 512, device="cpu")
    assert shape.engine == "flat" and shape.loss == "eager" and not shape.one_pass_adamw
    model = build_model(cfg.model, 512, seed=0)
    optimizer = build_optimizer(model, cfg.optimizer, derived.optimizer_type, derived.lr)
    engine = FlatEngine(FlatSettings.of(cfg, derived), model, optimizer, None)
    ids = torch.randint(0, 512, (2, cfg.model.seq_length), generator=torch.Generator())
    engine.backward(engine(ids, labels=ids))
    engine.step()

    groups = engine.groups
    states = [engine.optimizer.state[g.master] for g in groups]
    est = estimate_memory(cfg.model, shape)
    assert est.weights == sum(g.flat.nbytes for g in groups)
    assert est.gradients == sum(g.grad.nbytes for g in groups)
    assert est.master_weights == sum(g.master.nbytes for g in groups if g.master is not g.part)
    assert est.optimizer_states == sum(s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in states)
    assert est.buffers == est.gathered_params == 0
    # Off the GPU kernel, torch's fused AdamW steps on part_grad.float() (bf16 only).
    cast = sum(4 * g.size for g in groups) if precision == "bf16" else 0
    assert est.step_transient == cast
    assert sum(g.numel for g in groups) % 2  # odd: the padding was counted
    assert FLAT_ALIGNMENT == flat_engine.ALIGNMENT  # the torch-free copy of the engine's
    on_gpu = estimate_memory(cfg.model, training_shape(cfg, derived, 512))
    assert on_gpu.step_transient == 0 and on_gpu.model_states == est.model_states


# ZeRO-Offload of the optimizer at stages 1-3, and of the parameters at stage 3, in bf16.
OFFLOAD_CASES = {
    "zero1_optimizer": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    "zero2_optimizer": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "zero3_optimizer_params": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "stage3_param_persistence_threshold": 0,
    },
}


@pytest.mark.slow
def test_offload_host_memory_matches_deepspeed_engine(tmp_path):
    """Each host part of the estimate against the tensors DeepSpeed's offloading engine holds
    on two CPU ranks after a step (DeepSpeed's CPU Adam), and the GPU parts it moves away."""
    from tests.memory_helpers import measure_offload_all
    from tests.training.test_engine_offload import cpu_adam_builds

    if not cpu_adam_builds():
        pytest.skip("DeepSpeed's CPU Adam (a C++ op built on first use) cannot build here")
    flats = [
        dict(
            ENGINE_MODEL,
            zero_optimization=dict(zero, reduce_bucket_size=5000),
            bf16={"enabled": True},
        )
        for zero in OFFLOAD_CASES.values()
    ]
    out = tmp_path / "offload.json"
    run_ranks(measure_offload_all, 2, flats, str(out))
    for name, flat, measured in zip(OFFLOAD_CASES, flats, json.loads(out.read_text())):
        cfg = load_dict(flat)
        shape = training_shape(cfg, derive(cfg, 2, 512), 512, device="cpu")
        est = estimate_memory(cfg.model, shape)
        assert measured["optimizer_class"] == "DeepSpeedCPUAdam", name
        for part in (
            "host_master_weights",
            "host_gradients",
            "host_optimizer_states",
            "host_params",
            "host_buffers",
        ):
            assert measured[part] == getattr(est, part), (name, part, measured)
        assert est.master_weights == est.optimizer_states == est.step_transient == 0
        stage3 = flat["zero_optimization"]["stage"] == 3
        assert (est.weights == 0) == stage3 and (est.host_params > 0) == stage3
        # On a GPU each pinned buffer is rounded up to a power of two (torch's host allocator).
        pinned = estimate_memory(cfg.model, training_shape(cfg, derive(cfg, 2, 512), 512))
        assert pinned.host_total > est.host_total
        assert pinned.host_optimizer_states == est.host_optimizer_states  # CPU Adam's: unpinned


def test_host_refusal_names_the_offload_keys_when_the_host_cannot_hold_it():
    """Pythia 6.9B at ZeRO-3 with optimizer and parameters offloaded needs ~139 GiB of host
    memory (the H100 machine's 125 GiB host died of it); 2.8B (~61 GiB) fits; no offload, or
    skip_memory_check, asks nothing of the host."""
    from neox.config import load_config
    from neox.plan.report import host_refusal

    offload = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
        "model_parallel_size": 1,
        "fp16": {"enabled": False},
        "bf16": {"enabled": True},
    }
    host = 125 * 2**30

    def refusal(model, **extra):
        path = Path(__file__).resolve().parents[2] / "configs" / "pythia" / f"{model}.yml"
        cfg = load_config([str(path)], overrides={**offload, **extra}).config
        return host_refusal(cfg, derive(cfg, 1, 50277), 50432, 1, host, "this machine has")

    problem = refusal("6-9B")
    assert problem and "offload_param" in problem and "skip_memory_check" in problem
    assert "optimizer states 51.1 GiB" in problem
    assert refusal("2-8B") is None
    assert refusal("6-9B", skip_memory_check=True) is None
    assert refusal("6-9B", zero_optimization={"stage": 1}) is None


def test_preference_runs_count_the_reference_copy_and_both_answers():
    """DPO holds one more (frozen) copy of the weights and runs a pair's two answers as two
    rows; a reference-free run only the rows."""
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}
    base.update(
        max_position_embeddings=64, train_micro_batch_size_per_gpu=2, bf16={"enabled": True}
    )
    pairs = {
        "dataset_impl": "pairwise",
        "pos_train_data_paths": ["c"],
        "neg_train_data_paths": ["r"],
        "do_valid": False,
        "do_test": False,
        "train_impl": "dpo",
    }
    estimates = {}
    for name, flat in {
        "lm": base,
        "dpo": {**base, **pairs},
        "free": {**base, **pairs, "dpo_reference_free": True},
    }.items():
        cfg = load_dict(flat)
        shape = training_shape(cfg, derive(cfg, 1), 512)
        estimates[name] = (shape, estimate_memory(cfg.model, shape))
    (lm_shape, lm), (dpo_shape, dpo), (_, free) = (estimates[k] for k in ("lm", "dpo", "free"))
    assert dpo_shape.micro_batch == 2 * lm_shape.micro_batch and dpo_shape.loss == "eager"
    params = sum(p.numel() for p in build_model(load_dict(base).model, 512).parameters())
    assert dpo.weights - free.weights == 2 * params  # bf16
    assert free.optimizer_states == dpo.optimizer_states == lm.optimizer_states
    assert dpo.activations > lm.activations
