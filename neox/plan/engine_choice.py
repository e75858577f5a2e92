"""Which engine steps a run, whether torch_compile is on and how the loss runs: the decisions
that neox/training (engine.py, setup.py) and neox/parallel act on and the memory estimate
(neox/plan/memory.py) assumes.

Torch-free, from config-level facts, so that ``deepy.py --dry-run`` and tools/estimate.py
answer without torch and can never disagree with what a rank builds.
"""

from __future__ import annotations

from typing import Any, Optional

from neox.config.derived import Derived
from neox.config.ds_config import build_ds_config, zero_section
from neox.config.schema import NeoXConfig

# The optimizers the flat engine steps: torch's Adam and AdamW (neox builds torch's AdamW for the
# optimizer types adam and adamw, neox/training/optim.py).
FLAT_OPTIMIZERS = ("adam", "adamw")


def flat_engine_unsupported(
    ds_config: dict[str, Any],
    optimizer: str,
    lr_scaled: bool,
    data_parallel: int,
    model_parallel: int,
) -> Optional[str]:
    """Why neox's flat engine cannot run a job (None if it can): it covers data parallelism
    alone, bf16 or fp32, torch's Adam/AdamW, ZeRO 0-1 (0-2 on one rank) without offload.

    Args:
        ds_config: the DeepSpeed config (neox.config.build_ds_config).
        optimizer: "adam" or "adamw" for torch's Adam/AdamW, else any other name (shown).
        lr_scaled: whether any parameter group has an lr_scale other than 1.
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
    if lr_scaled:
        return "per-group learning-rate scales"
    return None


def one_pass_adamw(adamw: bool, amsgrad: bool, maximize: bool, device_type: str) -> bool:
    """Whether the flat engine steps with neox.kernels.adamw (one Triton pass over the bf16
    gradient) rather than torch's fused AdamW on an fp32 copy: plain AdamW on a GPU."""
    return device_type == "cuda" and adamw and not (amsgrad or maximize)


def torch_compile_enabled(setting: Optional[bool], device_type: str, tensor_parallel: int) -> bool:
    """The torch_compile setting, or when unset: on for GPU runs without tensor parallelism,
    where it was measured faster (docs/benchmarks.md); a tensor-parallel run on two H200 did not
    reach its first step within 120 s with it. Its likely cause, an RNG fork around every
    attention (a graph break), is gone; until a GPU run measures TP with compile, it stays
    opt-in there."""
    if setting is not None:
        return setting
    return device_type == "cuda" and tensor_parallel == 1


def loss_path(
    torch_compile: bool, tensor_parallel: int, pipe_parallel: int, chunk_size: int
) -> str:
    """How the training loss runs, as neox/parallel/build.py compile_blocks and neox/model/gpt.py
    decide: "chunked" (lm_loss_chunk_size), "compiled" (final norm, output layer and loss as one
    torch.compile graph: the plain model's own loss) or "eager" (the vocab-parallel loss of
    tensor parallelism and the pipeline's loss stay eager)."""
    if chunk_size:
        return "chunked"
    if torch_compile and tensor_parallel == 1 and pipe_parallel == 1:
        return "compiled"
    return "eager"


def engine_for(
    cfg: NeoXConfig, derived: Derived, zero_stage: Optional[int] = None
) -> tuple[str, Optional[str]]:
    """("flat" or "deepspeed", why not flat or None) for a validated config, as build_engine
    decides on the ranks (zero_stage replaces the configured stage, for estimates)."""
    ds_config = build_ds_config(cfg, derived)
    ds_config["zero_optimization"] = zero_section(cfg, derived.data_parallel, zero_stage)
    model_parallel = derived.tensor_parallel * derived.pipe_parallel
    # neox's optimizer groups never carry an lr_scale (neox/training/optim.py).
    reason = flat_engine_unsupported(
        ds_config, derived.optimizer_type, False, derived.data_parallel, model_parallel
    )
    if not cfg.training.flat_engine:
        return "deepspeed", reason or "flat_engine: false"
    return ("flat", None) if reason is None else ("deepspeed", reason)
