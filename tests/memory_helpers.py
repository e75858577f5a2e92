"""Rank body of tests/plan/test_memory.py: a real engine on CPU, its tensors measured.

Each rank builds the tiny model through neox's own parallelize/build_optimizer/build_ds_config
and the engine build_engine picks (DeepSpeed's or neox's flat engine), runs one
forward/backward and one optimizer step, and measures the bytes of the tensors the engine
actually holds: parameters, the gradients left after backward, the fp32 master copies and the
optimizer states. Rank 0 writes them as JSON for the test to compare.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def saved_activation_bytes(model: torch.nn.Module, ids: torch.Tensor, whole: bool = False) -> int:
    """Bytes of the distinct storages autograd saves in the blocks' forward, or with `whole` in
    the whole model's forward and the loss (never weights, nor rotary's cached cos/sin tables,
    which every layer shares)."""
    from neox.model import lm_loss

    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    # Position ids as training passes them (neox.data.batch), not the implicit 0..T-1.
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if whole:
            lm_loss(model(ids, positions), ids)
        else:
            x = model.embed(ids, positions)
            for block in model.layers:
                x = block(x, positions)
    for block in model.layers:
        rotary = block.attention.rotary
        for tables in rotary._cache.values() if rotary is not None else ():
            for t in tables:
                seen.pop(t.untyped_storage().data_ptr(), None)
    return sum(seen.values())


def held_gradients(engine, params) -> list:
    """Every gradient tensor DeepSpeed holds now: param.grad, ZeRO's gradient buckets, its
    contiguous partition buffers and the reduced partitions it will step on."""
    opt = engine.optimizer
    found = [p.grad for p in params]
    for name in ("grads_in_partition", "grad_partitions_flat_buffer"):
        found.append(getattr(opt, name, None))
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        buffer = bucket.buffer
        found += buffer if isinstance(buffer, list) else [buffer]
    for group in getattr(opt, "averaged_gradients", {}).values():
        flat = getattr(group, "flat_partition", None)
        found += [flat] if flat is not None else list(group or [])
    return [t for t in found if isinstance(t, torch.Tensor)]


# Where each DeepSpeed optimizer keeps its fp32 master weights: FP16_Optimizer (GPU) and
# FP16_UnfusedOptimizer (CPU) at stage 0, ZeRO 1/2, ZeRO-3.
MASTER_ATTRIBUTES = (
    "fp32_groups_flat",
    "fp32_groups",
    "single_partition_of_fp32_groups",
    "fp32_partitioned_groups_flat",
)


def _tensors(value) -> list:
    """The tensors in an attribute that is a tensor or a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def inner_optimizer(engine):
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def measure_all(rank: int, world: int, flats: list[dict], out: str) -> None:
    """measure() for each config in turn, in the same ranks (one spawn for all cases)."""
    results = [measure(rank, world, flat) for flat in flats]
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def measure(rank: int, world: int, flat: dict) -> dict:
    from neox.config import derive, load_dict
    from neox.parallel.build import engine_mpu, parallelize
    from neox.parallel.topology import ProcessGroups, Topology
    from neox.plan.engine_choice import engine_for
    from neox.training.optim import build_optimizer
    from neox.training.setup import build_engine

    cfg = load_dict(flat)
    vocab = cfg.tokenizer.padded_vocab_size
    derived = derive(cfg, world, vocab)
    groups = ProcessGroups(
        Topology(derived.tensor_parallel, derived.pipe_parallel, derived.data_parallel)
    )
    model = parallelize(cfg.model, vocab, groups, cfg.training.seed)
    choice = engine_for(cfg, derived)
    built = build_engine(
        choice,
        cfg,
        derived,
        model,
        build_optimizer(model, cfg.optimizer, choice.optimizer, derived.lr),
        engine_mpu(model, groups),
    )
    engine = getattr(built, "ds", built)  # DeepSpeed's own engine behind the adapter
    params = list(engine.module.parameters())
    if derived.precision == "bf16":
        dtype_ok = all(p.dtype == torch.bfloat16 for p in params)
    else:
        dtype_ok = all(p.dtype == torch.float32 for p in params)
    stage = engine.zero_optimization_stage()
    weights = [p.ds_tensor for p in params] if stage == 3 else params
    weight_bytes = storage_bytes(weights)

    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, vocab, (derived.micro_batch, cfg.model.seq_length), generator=g)
    logits = engine(ids)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    # The most gradient memory alive at any point of backward (DeepSpeed reduces and frees as
    # gradients arrive), sampled after each parameter's gradient is accumulated.
    peak = [0]

    def sample(_):
        peak[0] = max(peak[0], storage_bytes(held_gradients(engine, params)))

    hooks = [p.register_post_accumulate_grad_hook(sample) for p in params if p.requires_grad]
    engine.backward(loss)
    for h in hooks:
        h.remove()
    engine.step()

    inner = inner_optimizer(engine)
    model_storages = {t.untyped_storage().data_ptr() for t in weights}
    # The flat engine keeps its fp32 partitions on its groups (in fp32, views of the weights).
    flat_masters = [g.master for g in getattr(engine, "groups", [])]
    masters = [
        t
        for t in flat_masters
        + [t for name in MASTER_ATTRIBUTES for t in _tensors(getattr(engine.optimizer, name, None))]
        if t.untyped_storage().data_ptr() not in model_storages
    ]
    states = [
        t
        for state in inner.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    ]
    return dict(
        engine=type(engine).__name__,
        optimizer_class=type(engine.optimizer).__name__,
        dtype_ok=dtype_ok,
        weights=weight_bytes,
        gradients_peak=peak[0],
        master_weights=storage_bytes(masters),
        optimizer_states=storage_bytes(states),
    )


# Where DeepSpeed 0.19 keeps what ZeRO-Offload puts on the host, by the estimate's host parts.
OFFLOAD_ATTRIBUTES = {
    "host_params": ("param_groups_fp16_flat_cpu_memory",),
    "host_buffers": (
        "param_buffer_of_bit16_for_cpu_offload_groups",
        "temp_grad_buffer_for_cpu_offload",
    ),
}


def measure_offload_all(rank: int, world: int, flats: list[dict], out: str) -> None:
    """measure_offload() for each config in turn; rank 0 writes the results as JSON."""
    results = [measure_offload(rank, world, flat) for flat in flats]
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def measure_offload(rank: int, world: int, flat: dict) -> dict:
    """The host tensors a ZeRO-Offload engine holds after one step, by the estimate's parts:
    fp32 master partitions, their fp32 gradients (and ZeRO-3's flat gradient partition), CPU
    Adam's moments, ZeRO-3's offloaded parameter partitions, stage 1/2's staging buffers."""
    from neox.config import derive, load_dict
    from neox.parallel.build import engine_mpu, parallelize
    from neox.parallel.topology import ProcessGroups, Topology
    from neox.plan.engine_choice import engine_for
    from neox.training.optim import build_optimizer
    from neox.training.setup import build_engine

    cfg = load_dict(flat)
    vocab = cfg.tokenizer.padded_vocab_size
    derived = derive(cfg, world, vocab)
    groups = ProcessGroups(Topology(1, 1, derived.data_parallel))
    model = parallelize(cfg.model, vocab, groups, cfg.training.seed)
    choice = engine_for(cfg, derived)
    optimizer = build_optimizer(
        model, cfg.optimizer, choice.optimizer, derived.lr, choice.adamw_mode
    )
    built = build_engine(choice, cfg, derived, model, optimizer, engine_mpu(model, groups))
    engine = built.ds
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, vocab, (derived.micro_batch, cfg.model.seq_length), generator=g)
    logits = engine(ids)
    engine.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()))
    engine.step()

    opt = engine.optimizer
    masters = [t for name in MASTER_ATTRIBUTES for t in _tensors(getattr(opt, name, None))]
    grads = [t.grad for t in masters] + [getattr(opt, "grad_partitions_flat_buffer", None)]
    grads += list(getattr(opt, "accumulated_grads_in_cpu", {}).values())
    states = [
        t
        for state in inner_optimizer(engine).state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    ]
    out = dict(
        optimizer_class=type(inner_optimizer(engine)).__name__,
        host_master_weights=storage_bytes(masters),
        host_gradients=storage_bytes(grads),
        host_optimizer_states=storage_bytes(states),
    )
    for part, names in OFFLOAD_ATTRIBUTES.items():
        out[part] = storage_bytes(t for name in names for t in _tensors(getattr(opt, name, None)))
    built.destroy()
    return out
