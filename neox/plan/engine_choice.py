"""Which engine steps a run, whether torch_compile is on and how the loss runs: the decisions
that neox/training (engine.py, setup.py) and neox/parallel act on and the memory estimate
(neox/plan/memory.py) assumes.

Torch-free, from config-level facts, so that ``deepy.py --dry-run`` and tools/estimate.py
answer without torch and can never disagree with what a rank builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from neox.config.derived import Derived
from neox.config.ds_config import build_ds_config, zero_section
from neox.config.schema import NeoXConfig

# The optimizers the flat engine steps: torch's Adam and AdamW (neox builds torch's AdamW for the
# optimizer types adam and adamw, neox/training/optim.py).
FLAT_OPTIMIZERS = ("adam", "adamw")

# DeepSpeed config keys the flat engine honours as DeepSpeed's engine does (batch sizes,
# clipping, precision, ZeRO stage 0-1 and overlap_comm, comm dtype, the steps_per_print and
# wall_clock_breakdown logs), or that act outside the engine (activation_checkpointing:
# neox/parallel applies it to the model; zero_allow_untested_optimizer: neox's own flag for
# DeepSpeed's check). Any other key, or one of these set as only DeepSpeed implements it,
# runs on DeepSpeed's engine (`_flat_misses`); tests/training/test_engine_keys.py holds every
# key to its engine.
FLAT_KEYS = (
    *("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
    *("gradient_clipping", "steps_per_print", "bf16", "fp16", "zero_optimization"),
    *("fp32_allreduce", "communication_data_type", "data_types", "activation_checkpointing"),
    *("zero_allow_untested_optimizer", "prescale_gradients", "gradient_predivide_factor"),
    *("wall_clock_breakdown", "dump_state", "amp", "checkpoint"),
    *("flops_profiler", "comms_logger", "csv_monitor", "autotuning", "elasticity"),
)
# zero_optimization keys the flat engine reads: the stage, and overlap_comm with its
# reduce_bucket_size (gradients reduced in buckets during the backward, `overlaps_reduction`).
FLAT_ZERO_KEYS = ("stage", "overlap_comm", "reduce_bucket_size")
# zero_optimization keys that change nothing in the flat engine: it does one all-gather per
# parameter group, its gradients are always contiguous (views into one buffer), and DeepSpeed
# itself ignores the stage3_* keys below stage 3.
FLAT_ZERO_NO_OPS = (
    *("allgather_bucket_size", "allgather_partitions", "contiguous_gradients", "reduce_scatter"),
)
# DeepSpeed's default reduce_bucket_size (deepspeed/runtime/zero/config.py), in elements.
REDUCE_BUCKET_SIZE = 500_000_000
# Sections that do something only when enabled; off, neither engine acts on them.
ENABLED_SECTIONS = ("flops_profiler", "comms_logger", "csv_monitor")
# Sections neither engine can run from a neox launch: refused by name when enabled.
REFUSED_SECTIONS = {
    "amp": "DeepSpeed's AMP needs NVIDIA apex, which neox does not use; set precision: fp16 or "
    "bfloat16 and drop the amp section",
    "autotuning": "DeepSpeed's autotuner runs from its own launcher (deepspeed --autotuning), "
    "which neox does not wire; drop the autotuning section",
    "elasticity": "DeepSpeed's elastic training picks the batch size at launch (its elastic "
    "agent), while neox fixes it from train_batch_size; drop the elasticity section",
}
# Comm dtypes the flat engine reduces gradients in (communication_data_type's values).
COMM_DTYPES = ("fp32", "fp16", "bf16")
# ZeRO-Offload steps with DeepSpeed's CPU Adam (a client optimizer dies there): the optimizer
# types it stands in for. neox's adam is AdamW, as gpt-neox's FusedAdam (adam_w_mode=True).
OFFLOAD_ADAM = {"adam": True, "adamw": True, "cpu_adam": True, "cpu_torch_adam": True}

# Measured on one H100 at the 1.4B shape, 2026-11-26/27 (docs/benchmarks.md, "ZeRO-3: two
# faults" and "ZeRO-3 at one rank at micro batch 8 x 8").
ZERO3_ONE_RANK_NOTE = (
    "ZeRO-3 with one data-parallel rank partitions nothing: it holds what ZeRO-1 holds; at 1.4B "
    "on an H100 it ran at 0.93x the flat engine's tokens/s with micro batch 8 x 8 accumulation "
    "steps, 0.71x with micro batch 4 x 1 (its hooks' host work hides only behind long micro "
    "batches); zero_optimization.stage: 1 steps on the flat engine (ZeRO-3 pays off across "
    "ranks, or with offload_param)"
)


@dataclass(frozen=True)
class EngineChoice:
    """The engine and optimizer a run's ranks build (neox/training/setup.py build_engine)."""

    engine: str
    """"flat" (neox/training/flat_engine.py) or "deepspeed" (DeepSpeed's, through the adapter)."""
    reason: Optional[str]
    """Why not the flat engine; None when it runs."""
    optimizer: str
    """The optimizer type neox builds (neox/training/optim.py): the config's, or "cpu_adam" for
    ZeRO-Offload."""
    adamw_mode: bool = True
    """For cpu_adam: decoupled weight decay (AdamW)."""
    note: Optional[str] = None
    """What the choice changed of the config's own, for the dry run's engine line."""

    def describe(self) -> str:
        """This choice in words, as the ranks log it."""
        words = "neox's flat engine" if self.engine == "flat" else "DeepSpeed's engine"
        if self.reason:
            words += f" ({self.reason})"
        return words + (f"; {self.note}" if self.note else "")


def _enabled(section: Any) -> bool:
    if isinstance(section, dict):
        return bool(section.get("enabled", False))
    return bool(section)


def _flat_misses(ds_config: dict[str, Any], precision: str) -> Optional[str]:
    """The first DeepSpeed key of `ds_config` the flat engine does not honour, as words."""
    for key, value in ds_config.items():
        if key not in FLAT_KEYS:
            return f"DeepSpeed key {key}"
        if key in ENABLED_SECTIONS and _enabled(value):
            return f"{key} (DeepSpeed's)"
        if key in ("dump_state", "prescale_gradients") and value:
            return f"{key}: true"
        if key == "checkpoint" and value:
            return "checkpoint section (DeepSpeed's checkpoint engine options)"
        if key == "gradient_predivide_factor" and float(value) != 1.0:
            return f"gradient_predivide_factor={value}"
        if key == "bf16" and set(value) - {"enabled"}:
            return f"bf16.{sorted(set(value) - {'enabled'})[0]}"
        if key == "communication_data_type" and value not in COMM_DTYPES:
            return f"communication_data_type={value}"
        if key == "data_types":
            accum = (value or {}).get("grad_accum_dtype")
            if set(value or {}) - {"grad_accum_dtype"}:
                return f"data_types.{sorted(set(value) - {'grad_accum_dtype'})[0]}"
            if accum is not None and accum != precision:
                return f"data_types.grad_accum_dtype={accum} (the flat engine accumulates in {precision})"
        if key == "zero_optimization":
            for name in value:
                known = name in FLAT_ZERO_KEYS or name in FLAT_ZERO_NO_OPS
                if not known and not name.startswith("stage3_"):
                    return f"zero_optimization.{name}"
    return None


def flat_engine_unsupported(
    ds_config: dict[str, Any],
    optimizer: str,
    data_parallel: int,
    model_parallel: int,
) -> Optional[str]:
    """Why neox's flat engine cannot run a job (None if it can): it covers data parallelism
    alone, bf16 or fp32, torch's Adam/AdamW, ZeRO 0-1 (0-2 on one rank) without offload, and
    the DeepSpeed keys it honours (FLAT_KEYS, `_flat_misses`).

    Args:
        ds_config: the DeepSpeed config (neox.config.build_ds_config).
        optimizer: the optimizer type (Derived.optimizer_type): "adam" or "adamw" step flat.
        model_parallel: tensor x pipeline parallel size.
    """
    zero = ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if model_parallel > 1:
        return "tensor or pipeline parallelism"
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16 (loss scaling)"
    if stage > 2 or (stage == 2 and data_parallel > 1):
        return f"ZeRO-{stage} (gradient or weight partitioning)"
    if zero.get("offload_optimizer") or zero.get("offload_param"):
        return "ZeRO offload"
    if optimizer not in FLAT_OPTIMIZERS:
        return f"optimizer {optimizer}"
    precision = "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"
    return _flat_misses(ds_config, precision)


def choose_engine(
    ds_config: dict[str, Any],
    optimizer: str,
    data_parallel: int,
    model_parallel: int,
    flat_engine: bool = True,
) -> EngineChoice:
    """The one decision of which engine and optimizer a run steps with: deepy's dry run, the
    memory estimate and the ranks (neox/training/setup.py) all ask here.

    ZeRO-Offload (offload_optimizer at ZeRO 1-3) gets DeepSpeed's CPU Adam with the config's
    hyperparameters in place of neox's torch AdamW, which DeepSpeed refuses there.
    """
    from neox.config.errors import ConfigError

    for key, why in REFUSED_SECTIONS.items():
        if _enabled(ds_config.get(key)):
            raise ConfigError(f"{key}: {why}")
    reason = flat_engine_unsupported(ds_config, optimizer, data_parallel, model_parallel)
    if not flat_engine:
        reason = reason or "flat_engine: false"
    zero = ds_config.get("zero_optimization", {})
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if offload != "none":
        if zero.get("stage", 0) == 0:
            raise ConfigError(
                f"zero_optimization.offload_optimizer={{device: {offload}}} needs ZeRO stage 1-3 "
                "(DeepSpeed offloads the optimizer's partition); set zero_optimization.stage: 1 "
                "or drop offload_optimizer"
            )
        if optimizer not in OFFLOAD_ADAM:
            raise ConfigError(
                f"zero_optimization.offload_optimizer={{device: {offload}}} steps with "
                f"DeepSpeed's CPU Adam, not optimizer {optimizer}; use optimizer type Adam or "
                "AdamW, or drop offload_optimizer"
            )
        adamw = OFFLOAD_ADAM[optimizer]
        note = (
            f"optimizer: DeepSpeed's CPU Adam for zero_optimization.offload_optimizer (in place "
            f"of {optimizer}; adamw_mode={str(adamw).lower()})"
        )
        return EngineChoice("deepspeed", reason, "cpu_adam", adamw, note)
    note = None
    one_rank = data_parallel == 1 and model_parallel == 1  # the flat engine's ground
    if zero.get("stage", 0) == 3 and one_rank and not zero.get("offload_param"):
        note = ZERO3_ONE_RANK_NOTE
    return EngineChoice("flat" if reason is None else "deepspeed", reason, optimizer, note=note)


def one_pass_adamw(adamw: bool, amsgrad: bool, maximize: bool, device_type: str) -> bool:
    """Whether the flat engine steps with neox.kernels.adamw (one Triton pass over the bf16
    gradient) rather than torch's fused AdamW on an fp32 copy: plain AdamW on a GPU."""
    return device_type == "cuda" and adamw and not (amsgrad or maximize)


def comm_dtype(ds_config: dict[str, Any]) -> Optional[str]:
    """The dtype gradients are reduced in, as DeepSpeed reads its JSON: communication_data_type,
    else fp32 with fp32_allreduce; None: the gradients' own."""
    return ds_config.get("communication_data_type") or (
        "fp32" if ds_config.get("fp32_allreduce") else None
    )


def bucketing(ds_config: dict[str, Any]) -> tuple[bool, int]:
    """zero_optimization's overlap_comm and reduce_bucket_size as DeepSpeed's JSON holds them,
    with DeepSpeed's defaults (off; REDUCE_BUCKET_SIZE elements)."""
    zero = ds_config.get("zero_optimization") or {}
    return bool(zero.get("overlap_comm", False)), int(
        zero.get("reduce_bucket_size", REDUCE_BUCKET_SIZE)
    )


def overlaps_reduction(
    overlap_comm: bool, comm_dtype: Optional[str], precision: str, gradient_ranks: int
) -> Optional[str]:
    """Why the flat engine reduces gradients after the backward rather than in buckets during
    it (None: it overlaps). Buckets are all-reduced in place in the gradient buffer, so only in
    the gradients' own dtype; one rank has nothing to reduce.

    Args:
        comm_dtype: communication_data_type (or "fp32" for fp32_allreduce); None: the gradients'.
        precision: the gradients' dtype ("bf16" or "fp32").
        gradient_ranks: the ranks gradients are reduced over (data x context parallel).
    """
    if not overlap_comm:
        return "overlap_comm off"
    if gradient_ranks == 1:
        return "one data-parallel rank"
    if comm_dtype not in (None, precision):
        return f"communication in {comm_dtype}, not the gradients' {precision}"
    return None


def describe_reduction(ds_config: dict[str, Any], gradient_ranks: int, parameters: int) -> str:
    """How the flat engine reduces a run's gradients, in words, from the DeepSpeed config (the
    keys FlatSettings.of reads) and the model's parameter count."""
    precision = "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"
    overlap, size = bucketing(ds_config)
    why_not = overlaps_reduction(overlap, comm_dtype(ds_config), precision, gradient_ranks)
    if why_not is not None:
        return f"reduce-scattered after the backward ({why_not})"
    if parameters <= size:  # neox/training/grad_buckets.py: nothing to hide one bucket behind
        return f"reduce-scattered after the backward (the model fits one bucket of {size:,})"
    return f"all-reduced during the backward in buckets of up to {size:,} elements (overlap_comm)"


def torch_compile_enabled(setting: Optional[bool], device_type: str) -> bool:
    """The torch_compile setting, or when unset: on for GPU runs, where it was measured faster
    (docs/benchmarks.md: 1.2-1.3x at Pythia shapes on one GPU, 1.39x eager TP=2 with the same
    losses), off on CPU, where compiling costs more than short runs save."""
    if setting is not None:
        return setting
    return device_type == "cuda"


def loss_path(torch_compile: bool, chunk_size: int) -> str:
    """How the training loss runs, as neox/parallel/build.py compile_blocks and neox/model/gpt.py
    decide: "chunked" (lm_loss_chunk_size), "compiled" (output layer and loss as one
    torch.compile graph: the model's own loss, vocab-parallel under tensor parallelism, or a
    pipeline's last stage's loss_fn) or "eager" (torch_compile off)."""
    if chunk_size:
        return "chunked"
    return "compiled" if torch_compile else "eager"


def engine_for(cfg: NeoXConfig, derived: Derived, zero_stage: Optional[int] = None) -> EngineChoice:
    """choose_engine for a validated config (zero_stage replaces the configured stage, for
    estimates of each stage)."""
    ds_config = build_ds_config(cfg, derived)
    zero = zero_section(cfg, derived.data_parallel, zero_stage)
    if zero_stage == 0:  # an estimate of stage 0: no partition there to offload
        zero = {k: v for k, v in zero.items() if k not in ("offload_optimizer", "offload_param")}
    ds_config["zero_optimization"] = zero
    return choose_engine(
        ds_config,
        derived.optimizer_type,
        derived.data_parallel,
        derived.tensor_parallel * derived.pipe_parallel,
        cfg.training.flat_engine,
    )
