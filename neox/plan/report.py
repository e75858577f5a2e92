"""The estimate as people read it: parameters, FLOPs, memory per ZeRO stage, tokens/s, fit check.

Shared by tools/estimate.py and deepy.py (dry run and the warning before launch); torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from neox.config.derived import Derived, padded_vocab
from neox.config.ds_config import build_ds_config
from neox.config.schema import NeoXConfig
from neox.plan.engine_choice import describe_reduction, engine_for, torch_compile_enabled
from neox.plan.estimate import (
    active_parameters,
    all_to_all_bytes,
    count_parameters,
    embedding_parameters,
    expert_parameters,
    train_flops_per_token,
)
from neox.plan.memory import (
    HOST_PROCESS_BYTES,
    GiB,
    MemoryEstimate,
    TrainingShape,
    estimate_memory,
    training_shape,
)

# Dense bf16/fp16 tensor-core peak per GPU, TFLOPS (no sparsity), and memory in GiB.
GPUS = {
    "h100": {"peak_tflops": 989.0, "memory_gib": 79.6},
    "h200": {"peak_tflops": 989.0, "memory_gib": 139.8},
    "a100": {"peak_tflops": 312.0, "memory_gib": 79.2},
}
# When no tokenizer is at hand: the GPT-NeoX-20B tokenizer's vocabulary (padded as configured).
DEFAULT_VOCAB = 50277

MEMORY_ROWS = (
    ("weights", "weights"),
    ("gradients", "gradients"),
    ("master_weights", "fp32 master weights"),
    ("optimizer_states", "optimizer states"),
    ("buffers", "ZeRO gradient buckets"),
    ("gathered_params", "ZeRO-3 gathered params"),
    ("step_transient", "optimizer-step fp32 grads"),
    ("activations", "activations"),
    ("logits", "loss over the logits"),
    ("peak_allocated", "peak allocated"),
    ("peak_reserved", "peak reserved"),
    ("total", "total incl. CUDA context"),
    ("host_total", "host, ZeRO-Offload and async_save staging (per rank)"),
)


def estimate_vocab(cfg: NeoXConfig, derived: Derived) -> tuple[int, str]:
    """(padded vocabulary, where it came from): the tokenizer's, or GPT-NeoX-20B's without one."""
    if derived.padded_vocab_size is not None:
        return derived.padded_vocab_size, "tokenizer"
    return padded_vocab(
        cfg, DEFAULT_VOCAB
    ), f"no tokenizer here: assumed GPT-NeoX-20B's {DEFAULT_VOCAB}"


def memory_by_stage(
    cfg: NeoXConfig, derived: Derived, vocab_size: int, checkpoint_activations: bool
) -> list[MemoryEstimate]:
    """Estimates for ZeRO stages 0-3 of this config, with activation checkpointing on or off."""
    out = []
    for stage in range(4):
        shape = training_shape(cfg, derived, vocab_size, zero_stage=stage)
        shape = dataclasses.replace(shape, checkpoint_activations=checkpoint_activations)
        out.append(estimate_memory(cfg.model, shape))
    return out


def describe_engines(cfg: NeoXConfig, derived: Derived, vocab_size: int) -> str:
    """One line: the engine each ZeRO column assumes, how the loss runs on a GPU and, where the
    flat engine reduces gradients over ranks, when."""
    shapes = [training_shape(cfg, derived, vocab_size, zero_stage=s) for s in range(4)]
    by_engine: dict[str, list[str]] = {}
    for shape in shapes:
        by_engine.setdefault(shape.engine, []).append(str(shape.zero_stage))
    names = {"flat": "neox's flat engine", "deepspeed": "DeepSpeed's"}
    engines = "; ".join(f"{names[e]} at ZeRO {', '.join(s)}" for e, s in by_engine.items())
    choice = engine_for(cfg, derived)
    if not cfg.training.flat_engine:
        engines += " (flat_engine: false)"
    elif choice.engine == "deepspeed":
        engines += f" (the flat engine does not cover {choice.reason})"
    if choice.note:
        engines += f"; {choice.note}"
    words = {
        "compiled": f"compiled with the output layer (torch_compile), {derived.precision} logits",
        "chunked": f"chunked, {cfg.model.lm_loss_chunk_size} tokens at a time",
        "eager": "eager, fp32 log-softmax over the logits",
    }
    line = f"engine: {engines}; loss: {words[shapes[0].loss]}"
    gradient_ranks = derived.data_parallel * derived.context_parallel
    if choice.engine == "flat" and gradient_ranks > 1:
        ds_config = build_ds_config(cfg, derived)
        n = count_parameters(cfg.model, vocab_size)
        line += f"; gradients: {describe_reduction(ds_config, gradient_ranks, n)}"
    return line


def tokens_per_second(
    cfg: NeoXConfig, vocab_size: int, gpus: int, peak_tflops: float, mfu: float
) -> float:
    """Training throughput of `gpus` GPUs running at `mfu` of their peak."""
    return mfu * peak_tflops * 1e12 * gpus / train_flops_per_token(cfg.model, vocab_size)


def moe_lines(cfg: NeoXConfig, d: Derived, vocab_size: int) -> list[str]:
    """Active parameters, expert weights per rank and all-to-all traffic of an MoE model."""
    m = cfg.model
    if m.moe_num_experts == 1:
        return []
    ep = m.moe_expert_parallel_size
    tokens = d.micro_batch * d.grad_accum * m.seq_length
    k = 4 if d.precision == "fp32" else 2
    experts = expert_parameters(m)  # every rank holds them all, whatever the EP size
    layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    return [
        f"MoE: {layers} of {m.num_layers} layers, {m.moe_num_experts} experts, top-"
        f"{m.moe_top_k}; {active_parameters(m, vocab_size):,} active parameters per token "
        f"(FLOPs and MFU count these)",
        f"experts per rank: {experts:,} parameters, {experts * k / GiB:.2f} GiB of {d.precision} "
        f"weights (all of them; expert parallel size {ep} splits their compute, "
        f"{expert_parameters(m, ep):,} per rank); all-to-all per rank per step: "
        f"{all_to_all_bytes(m, tokens, ep, k) / GiB:.2f} GiB",
    ]


def _gib(n: int) -> str:
    return f"{n / GiB:8.2f}"


def estimate_report(
    cfg: NeoXConfig,
    derived: Derived,
    vocab_size: int,
    gpu: str = "h100",
    mfu: float = 0.4,
    peak_tflops: Optional[float] = None,
) -> str:
    """The whole estimate as text: sizes, FLOPs, a memory table per ZeRO stage, throughput."""
    m, d = cfg.model, derived
    peak = peak_tflops if peak_tflops is not None else GPUS[gpu]["peak_tflops"]
    total = count_parameters(m, vocab_size)
    per_rank = count_parameters(m, vocab_size, d.tensor_parallel, d.pipe_parallel)
    flops = train_flops_per_token(m, vocab_size)
    configured = training_shape(cfg, derived, vocab_size).zero_stage
    ckpt = cfg.training.checkpoint_activations
    cp = f"cp {d.context_parallel} (a chunk of {m.seq_length // d.context_parallel} tokens each) x "
    tp = f"tp {d.tensor_parallel}"
    if cfg.parallel.splits_sequence:
        tp += f" (sequence parallel: {m.seq_length // d.tensor_parallel} tokens between layers)"
    lines = [
        f"layout: {d.world_size} GPU(s) = {tp} x pp {d.pipe_parallel} x "
        f"{cp if d.context_parallel > 1 else ''}"
        f"dp {d.data_parallel}; micro batch {d.micro_batch} x seq {m.seq_length}, "
        f"accumulation {d.grad_accum}, {d.precision}; padded vocab {vocab_size}",
        f"parameters: {total:,} total, {total - embedding_parameters(m, vocab_size):,} "
        f"non-embedding, {per_rank:,} on the largest tp/pp rank",
        *moe_lines(cfg, derived, vocab_size),
        f"training FLOPs per token: {flops:.4g} (6N + 12 L h s)",
        "",
        f"memory per GPU, GiB (ZeRO stage configured: {configured}; activation checkpointing "
        f"{'on' if ckpt else 'off'})",
        describe_engines(cfg, derived, vocab_size),
        f"{'':32}" + "".join(f"  ZeRO-{s}{'*' if s == configured else ' '}" for s in range(4)),
    ]
    table = memory_by_stage(cfg, derived, vocab_size, ckpt)
    for key, label in MEMORY_ROWS:
        values = [e.as_dict()[key] for e in table]
        lines.append(f"{label:32}" + "".join(f" {_gib(v)}" for v in values))
    other = memory_by_stage(cfg, derived, vocab_size, not ckpt)
    lines.append(
        f"{'total, checkpointing ' + ('off' if ckpt else 'on'):32}"
        + "".join(f" {_gib(e.total)}" for e in other)
    )
    tps = tokens_per_second(cfg, vocab_size, d.world_size, peak, mfu)
    step_s = d.global_batch * m.seq_length / tps
    lines += [
        "",
        f"throughput at MFU {mfu:g} of {peak:g} TFLOPS/GPU ({gpu}): {tps:,.0f} tokens/s, "
        f"{step_s:.3g} s per step of {d.global_batch * m.seq_length:,} tokens",
    ]
    return "\n".join(lines)


def fit_warning(
    cfg: NeoXConfig, derived: Derived, vocab_size: int, gpu_bytes: int
) -> Optional[str]:
    """A warning when the configured run needs more than `gpu_bytes` per GPU, else None."""
    shape: TrainingShape = training_shape(cfg, derived, vocab_size)
    need = estimate_memory(cfg.model, shape).total
    if need <= gpu_bytes:
        return None
    hints = []
    if shape.zero_stage < 3 and derived.data_parallel > 1:
        hints.append("a higher zero_optimization.stage")
    compiled = torch_compile_enabled(cfg.training.torch_compile, "cuda")
    if not shape.checkpoint_activations and compiled and shape.activation_memory_budget == 1:
        # Selective recompute: at long sequences it keeps the attention outputs that
        # checkpoint_activations recomputes (docs/benchmarks.md).
        hints.append("activation_memory_budget: 0.75 (recompute part of each compiled block)")
    if not shape.checkpoint_activations:
        hints.append("checkpoint_activations: true")
    hints += [
        "a smaller train_micro_batch_size_per_gpu",
        "a larger model_parallel_size or pipe_parallel_size",
    ]
    return (
        f"estimated {need / GiB:.1f} GiB per GPU exceeds the {gpu_bytes / GiB:.1f} GiB this GPU "
        f"has (python tools/estimate.py shows the parts); consider {', '.join(hints)}"
    )


# checkpoint_activations is worth its recompute only where the run would not fit without it:
# neox suggests turning it off when the estimate without it fits in this share of the GPU.
RECOMPUTE_HEADROOM = 0.85


def recompute_note(
    cfg: NeoXConfig, derived: Derived, vocab_size: int, gpu_bytes: int
) -> Optional[str]:
    """A note when checkpoint_activations is on but the run fits without it (RECOMPUTE_HEADROOM),
    else None. gpt-neox's configs/20B.yml turns it on for 44 layers over 8 GPUs; cut to fewer
    layers or on larger GPUs, it recomputes every block's forward to save memory the run has."""
    shape: TrainingShape = training_shape(cfg, derived, vocab_size)
    if not shape.checkpoint_activations:
        return None
    without = dataclasses.replace(shape, checkpoint_activations=False)
    need = estimate_memory(cfg.model, without).total
    if need > RECOMPUTE_HEADROOM * gpu_bytes:
        return None
    return (
        f"checkpoint_activations is on, but the estimate without it ({need / GiB:.1f} GiB) fits "
        f"this GPU's {gpu_bytes / GiB:.1f} GiB: checkpoint_activations: false skips recomputing "
        "every block's forward (1.24x the tokens/s for configs/20B.yml at 4 layers on one H200, "
        "docs/benchmarks.md)"
    )


# An estimate this many times over the memory a rank has is a mistake (a typo in seq_length,
# batch or width), not a tight fit the estimate may have over-counted.
FIT_MARGIN = 2.0


def fit_refusal(
    cfg: NeoXConfig, derived: Derived, vocab_size: int, rank_bytes: int, what: str
) -> Optional[str]:
    """Why the launch is refused: the estimate is over FIT_MARGIN x `rank_bytes` per rank (`what`
    says whose memory that is); None when it fits or launcher.skip_memory_check is set."""
    if cfg.launcher.skip_memory_check:
        return None
    need = estimate_memory(cfg.model, training_shape(cfg, derived, vocab_size)).total
    if need <= FIT_MARGIN * rank_bytes:
        return None
    return (
        f"estimated {_size(need)} per rank is over {FIT_MARGIN:g}x the {_size(rank_bytes)} "
        f"{what} (seq_length={cfg.model.seq_length}, micro batch {derived.micro_batch}, "
        f"hidden_size={cfg.model.hidden_size}; python tools/estimate.py shows the parts); fix "
        "the config, or set skip_memory_check: true to launch anyway"
    )


def host_refusal(
    cfg: NeoXConfig,
    derived: Derived,
    vocab_size: int,
    ranks_per_node: int,
    host_bytes: int,
    what: str,
) -> Optional[str]:
    """Why the launch is refused: ZeRO-Offload's host memory for `ranks_per_node` ranks (plus
    HOST_PROCESS_BYTES each) exceeds `host_bytes` (`what` says whose); None when it fits, when
    nothing is offloaded, or when launcher.skip_memory_check is set."""
    if cfg.launcher.skip_memory_check:
        return None
    est = estimate_memory(cfg.model, training_shape(cfg, derived, vocab_size))
    if not est.host_total:
        return None
    need = ranks_per_node * (est.host_total + HOST_PROCESS_BYTES)
    if need <= host_bytes:
        return None
    parts = ", ".join(
        f"{label} {_size(value)}"
        for label, value in (
            ("fp32 master weights", est.host_master_weights),
            ("gradients", est.host_gradients),
            ("optimizer states", est.host_optimizer_states),
            ("parameters (offload_param)", est.host_params),
            ("staging/swap buffers", est.host_buffers),
            ("checkpoint staging (async_save)", est.host_checkpoint_staging),
        )
        if value
    )
    return (
        f"ZeRO-Offload and async_save need an estimated {_size(need)} of host memory per node, "
        f"over the "
        f"{_size(host_bytes)} {what}: {ranks_per_node} rank(s) x ({parts}, plus "
        f"{_size(HOST_PROCESS_BYTES)} per process); drop zero_optimization.offload_param, set "
        "zero_optimization.offload_optimizer.device: nvme (with nvme_path), use fewer ranks per "
        "node, or set skip_memory_check: true to launch anyway"
    )


def _size(n: float) -> str:
    for unit in ("GiB", "TiB", "PiB", "EiB"):
        if n < 1024 * GiB or unit == "EiB":
            return f"{n / GiB:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
