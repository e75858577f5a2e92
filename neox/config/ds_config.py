"""The DeepSpeed config dict, built from the validated config and its derived values."""

from typing import Any, Optional

from neox.config.derived import Derived
from neox.config.errors import ConfigError
from neox.config.schema import NeoXConfig

# ZeRO-3's defaults that neox changes where the config is silent (docs/benchmarks.md, "ZeRO-3 at
# one rank: what costs the time"). DeepSpeed hooks every module; inside a torch.compile'd block
# each hook is a graph break, so the block ran as a graph per linear. As a leaf, a block's
# weights are gathered by its own hooks, all at once, and its compiled graph stays whole.
# (DeepSpeed's memory_efficient_linear stays on for eager code: without it an eager linear saves
# a view of its gathered weight for backward, so every weight stays gathered from forward to
# backward. Compiled blocks get torch's linear: neox/training/deepspeed_engine.py says why.)
BLOCK_CLASS = "neox.model.block.Block"
ZERO3_DEFAULTS: dict[str, Any] = {"leaf_module": {"classes": [BLOCK_CLASS]}}


def zero_section(
    cfg: NeoXConfig, data_parallel: int, stage: Optional[int] = None
) -> dict[str, Any]:
    """zero_optimization, with gpt-neox's zero_* shorthands filled in where the section is silent
    (`stage` replaces the configured stage, for estimates of another one).

    At stage 3 (without DeepCompile), ZERO3_DEFAULTS where the section does not set the key.

    With one data-parallel rank (and no offload), ZeRO 1/2 has nothing to communicate: overlap_comm and
    contiguous_gradients then only add gradient copies (5% of a Pythia-410M step on an H100,
    docs/benchmarks.md), so they are turned off; states and checkpoints are the same.
    """
    ds = cfg.deepspeed
    zero = dict(ds.zero_optimization or {})
    for short, key in (
        ("zero_reduce_scatter", "reduce_scatter"),
        ("zero_contiguous_gradients", "contiguous_gradients"),
        ("zero_reduce_bucket_size", "reduce_bucket_size"),
        ("zero_allgather_bucket_size", "allgather_bucket_size"),
    ):
        value = getattr(ds, short)
        if value is not None:
            zero.setdefault(key, value)
    # gpt-neox configs still say `cpu_offload`; DeepSpeed now wants offload_optimizer.
    if zero.pop("cpu_offload", False):
        zero.setdefault("offload_optimizer", {"device": "cpu"})
    zero["stage"] = cfg.deepspeed.stage if stage is None else stage
    if data_parallel == 1 and zero["stage"] in (1, 2) and "offload_optimizer" not in zero:
        zero.update(overlap_comm=False, contiguous_gradients=False)
    # DeepCompile removes the module hooks and never sets up the buckets a leaf's gradient
    # hook reduces into (KeyError at the first backward, docs/benchmarks.md): no leaves there.
    deepcompile = ((ds.deepspeed_extra_args or {}).get("compile") or {}).get("deepcompile")
    if zero["stage"] == 3 and not deepcompile:
        for key, value in ZERO3_DEFAULTS.items():
            zero.setdefault(key, value)
    return zero


def precision_sections(cfg: NeoXConfig, d: Derived) -> dict[str, Any]:
    p = cfg.precision
    if d.precision == "fp16":
        fp16 = {k: v for k, v in (p.fp16 or {}).items() if k != "fp16"}  # gpt-neox repeats a flag
        fp16["enabled"] = True
        if p.dynamic_loss_scale:  # derive() has refused it beside a static scale
            fp16.setdefault("loss_scale", 0)
        if p.loss_scale is not None:
            fp16.setdefault("loss_scale", p.loss_scale)
        fp16.setdefault("loss_scale_window", p.loss_scale_window)
        fp16.setdefault("hysteresis", p.hysteresis)
        fp16.setdefault("min_loss_scale", p.min_scale)
        return {"fp16": fp16}
    if d.precision == "bf16":
        return {"bf16": {**(p.bf16 or {}), "enabled": True}}
    return {}


def activation_checkpointing_section(cfg: NeoXConfig) -> dict[str, Any]:
    t = cfg.training
    section = {
        "partition_activations": t.partition_activations,
        "contiguous_memory_optimization": t.contiguous_checkpointing,
        "cpu_checkpointing": t.checkpoint_in_cpu,
        "number_checkpoints": t.checkpoint_num_layers,
        "synchronize_checkpoint_boundary": t.synchronize_each_layer,
        "profile": t.profile_backward,
    }
    section.update(cfg.deepspeed.activation_checkpointing or {})
    if cfg.parallel.splits_sequence:
        # Block inputs are already split by sequence (neox/parallel/activation_checkpointing.py).
        section["partition_activations"] = False
    return section


# DeepSpeed's pipeline sends 1/tp of a stage's output from each tp rank and all-gathers it on
# the next stage, which assumes the tp ranks hold the same activations; under sequence
# parallelism each holds its own chunk of the sequence, so each sends the whole of it.
SEQUENCE_PARALLEL_PIPELINE = {"pipe_partitioned": False, "grad_partitioned": False}


def build_ds_config(cfg: NeoXConfig, d: Derived) -> dict[str, Any]:
    """DeepSpeed config for deepspeed.initialize; the optimizer and LR schedule are neox's own."""
    t, ds, lg = cfg.training, cfg.deepspeed, cfg.logging
    clip = t.clip_grad if t.clip_grad is not None else t.gradient_clipping
    out: dict[str, Any] = {
        # DeepSpeed counts a context-parallel rank as a data-parallel one (it reduces gradients
        # over both): to it each sample is cp samples of a chunk each.
        "train_batch_size": d.global_batch * d.context_parallel,
        "train_micro_batch_size_per_gpu": d.micro_batch,
        "gradient_accumulation_steps": d.grad_accum,
        "gradient_clipping": clip,
        "steps_per_print": lg.steps_per_print,
        "wall_clock_breakdown": lg.wall_clock_breakdown,
        "zero_optimization": zero_section(cfg, d.data_parallel * d.context_parallel),
        # neox hands DeepSpeed its own optimizer object, which ZeRO must accept.
        "zero_allow_untested_optimizer": True,
        "prescale_gradients": ds.prescale_gradients,
        "gradient_predivide_factor": ds.gradient_predivide_factor,
        "dump_state": ds.dump_state,
        "activation_checkpointing": activation_checkpointing_section(cfg),
        **precision_sections(cfg, d),
    }
    if cfg.precision.fp32_allreduce:
        out["fp32_allreduce"] = True
    if cfg.precision.communication_data_type:
        out["communication_data_type"] = cfg.precision.communication_data_type
    if cfg.precision.amp:
        out["amp"] = cfg.precision.amp
    for name in (
        "flops_profiler",
        "comms_logger",
        "autotuning",
        "elasticity",
        "csv_monitor",
        "checkpoint",
        "data_types",
    ):
        section = getattr(ds, name)
        if section is not None:
            out[name] = section
    out.update(ds.deepspeed_extra_args or {})
    if cfg.parallel.splits_sequence and d.pipe_parallel > 1:
        given = out.get("pipeline") or {}
        if clash := {k: v for k, v in given.items() if SEQUENCE_PARALLEL_PIPELINE.get(k, v) != v}:
            raise ConfigError(
                f"deepspeed_extra_args.pipeline {clash} cannot hold with sequence_parallel: true "
                "(each tensor-parallel rank sends its own chunk of the sequence whole); remove it"
            )
        out["pipeline"] = {**given, **SEQUENCE_PARALLEL_PIPELINE}
    return out
