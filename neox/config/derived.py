"""Values computed from the config, never read from YAML: layout, batch triple, vocab,
schedule, precision. Everything else reads them from here rather than working them out again
(the model's own shape is `ModelConfig.shape`, neox/config/shape.py).

`derive` also runs the rules that need the run's layout or batch; the rules still here move to
the groups that own their keys. The schema is imported for type hints only."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

from neox.config.errors import ConfigError
from neox.config.optimizer import OPTIMIZER_TYPES
from neox.config.parallel import check_model_split, divisors
from neox.config.shape import ModelShape

if TYPE_CHECKING:
    from neox.config.schema import NeoXConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Derived:
    """What a run computes once from its config and world size."""

    world_size: int
    tensor_parallel: int
    pipe_parallel: int
    data_parallel: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    precision: str  # "fp32" | "fp16" | "bf16"
    lr_decay_iters: int
    warmup_iters: int
    padded_vocab_size: Optional[int]
    optimizer_type: str  # lower case: adam, adamw, cpu_adam, sgd, lion...
    lr: float  # peak learning rate
    samples: tuple[int, int, int]  # train, valid, test samples the whole run draws
    zero_stage: int
    model: ModelShape

    def as_dict(self) -> dict:
        return asdict(self)


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Round the vocabulary up so each tensor-parallel shard is a multiple of divisible_by."""
    multiple = divisible_by * tensor_parallel
    return multiple * math.ceil(vocab_size / multiple)


def padded_vocab(cfg: NeoXConfig, vocab_size: Optional[int]) -> Optional[int]:
    """Embedding rows of the model: padded_vocab_size, or the tokenizer's vocabulary padded
    (None when neither is known yet, as in a dry run without tokenizer files)."""
    padded = cfg.tokenizer.padded_vocab_size
    tp = cfg.parallel.model_parallel_size
    if vocab_size is not None:
        if padded is None:
            padded = pad_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
        elif padded < vocab_size:
            raise ConfigError(
                f"padded_vocab_size={padded} is smaller than the tokenizer's vocabulary "
                f"({vocab_size}); remove padded_vocab_size or raise it"
            )
    if padded is not None and padded % tp:
        raise ConfigError(
            f"padded_vocab_size={padded} is not divisible by model_parallel_size={tp}; "
            "remove padded_vocab_size to derive it"
        )
    return padded


def batch_triple(cfg: NeoXConfig, dp: int) -> tuple[int, int, int]:
    """(micro batch, accumulation steps, global batch): any two give the third."""
    t = cfg.training
    micro = t.train_micro_batch_size_per_gpu or t.batch_size
    gas, glob = t.gradient_accumulation_steps, t.train_batch_size
    dp_is = f"data-parallel size {dp}"
    if micro is not None and gas is not None and glob is not None:
        if micro * gas * dp != glob:
            raise ConfigError(
                f"train_batch_size={glob} != train_micro_batch_size_per_gpu={micro} x "
                f"gradient_accumulation_steps={gas} x data-parallel size {dp} = {micro * gas * dp}; "
                "set any two of the three and neox derives the third"
            )
    elif micro is not None and gas is not None:
        glob = micro * gas * dp
    elif micro is not None and glob is not None:
        gas = _exact_div(glob, micro * dp, f"train_micro_batch_size_per_gpu={micro} x {dp_is}")
    elif gas is not None and glob is not None:
        micro = _exact_div(glob, gas * dp, f"gradient_accumulation_steps={gas} x {dp_is}")
    elif micro is not None:
        gas, glob = 1, micro * dp
    elif glob is not None:
        gas = 1
        micro = _exact_div(glob, dp, dp_is)
    else:
        micro, gas = 1, gas or 1
        glob = micro * gas * dp
    for name, v in (("micro batch", micro), ("gradient_accumulation_steps", gas)):
        if v < 1:
            raise ConfigError(f"{name}={v} must be >= 1")
    return micro, gas, glob


def _exact_div(glob: int, part: int, part_is: str) -> int:
    if part == 0 or glob % part:
        raise ConfigError(
            f"train_batch_size={glob} is not divisible by {part_is} = {part}; set any two of "
            "train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps "
            "that fit, and neox derives the third"
        )
    return glob // part


def precision_of(cfg: NeoXConfig) -> str:
    """fp16, bf16 or fp32, from the DeepSpeed sections or gpt-neox's `precision`."""
    p = cfg.precision
    fp16 = bool(p.fp16 and p.fp16.get("enabled", True))
    bf16 = bool(p.bf16 and p.bf16.get("enabled", True))
    if fp16 and bf16:
        raise ConfigError("fp16 and bf16 are both enabled; enable one of them")
    from_sections = "fp16" if fp16 else "bf16" if bf16 else None
    named = {"bfloat16": "bf16"}.get(p.precision or "", p.precision)
    if named and from_sections and named != from_sections:
        raise ConfigError(
            f"precision={p.precision!r} contradicts the enabled {from_sections} section; "
            "keep them consistent or drop `precision`"
        )
    return from_sections or named or "fp32"


def optimizer_type(cfg: NeoXConfig) -> str:
    """optimizer.type, or gpt-neox's flat optimizer_type when no `optimizer` section is given."""
    o = cfg.optimizer
    section = "optimizer" in o.model_fields_set
    if o.optimizer_type is None:
        return o.optimizer.type.lower()
    if section and o.optimizer_type.lower() != o.optimizer.type.lower():
        raise ConfigError(
            f"optimizer_type={o.optimizer_type!r} contradicts optimizer.type="
            f"{o.optimizer.type!r}; keep one of them"
        )
    kind = o.optimizer_type.lower()
    if kind not in OPTIMIZER_TYPES:
        raise ConfigError(
            f"optimizer_type={o.optimizer_type!r} is not available; use one of {OPTIMIZER_TYPES}"
        )
    return kind


def peak_lr(cfg: NeoXConfig) -> float:
    """gpt-neox's top-level `lr` wins over optimizer.params.lr."""
    o = cfg.optimizer
    return float(o.lr) if o.lr is not None else o.optimizer.lr


def sample_counts(cfg: NeoXConfig, global_batch: int) -> tuple[int, int, int]:
    """Samples of each split the run consumes, so the sample index is built once for all."""
    t = cfg.training
    # Every scheduled validation, and one more: the pass of an evaluation-only run.
    evals = validations_before(cfg, t.train_iters) + 1 if t.do_valid else 0
    return (
        t.train_iters * global_batch,
        evals * t.eval_iters * global_batch,
        t.eval_iters * global_batch if t.do_test else 0,
    )


def validations_before(cfg: NeoXConfig, iteration: int) -> int:
    """Validation passes in a run's first `iteration` steps (one each eval_interval)."""
    t = cfg.training
    return iteration // t.eval_interval if t.do_valid else 0


def consumed_samples(cfg: NeoXConfig, global_batch: int, iteration: int) -> tuple[int, int]:
    """(train, valid) samples drawn in the first `iteration` steps: where a resumed run's data
    streams continue."""
    valid = validations_before(cfg, iteration) * cfg.training.eval_iters * global_batch
    return iteration * global_batch, valid


def schedule_iters(cfg: NeoXConfig) -> tuple[int, int]:
    """(decay iterations, warmup iterations)."""
    o, iters = cfg.optimizer, cfg.training.train_iters
    if o.lr_decay_fraction is not None:
        decay = int(o.lr_decay_fraction * iters)
    else:
        decay = o.lr_decay_iters if o.lr_decay_iters is not None else iters
    return decay, int(o.warmup * decay)


def derive(cfg: NeoXConfig, world_size: int, vocab_size: Optional[int] = None) -> Derived:
    """Compute layout, batch, precision, schedule and padded vocab; raise ConfigError when off."""
    dp = data_parallel_size(world_size, cfg.parallel.model_parallel_size, cfg.parallel.pp)
    check_model_split(cfg.model, cfg.parallel.model_parallel_size, cfg.parallel.pp)
    micro, gas, glob = batch_triple(cfg, dp)
    decay, warmup = schedule_iters(cfg)
    padded = padded_vocab(cfg, vocab_size)
    check_pipeline_clipping(cfg, precision_of(cfg))
    check_loss_scale(cfg, precision_of(cfg))
    check_float8(cfg, precision_of(cfg))
    check_pipeline_inputs(cfg)
    check_as_gpt_neox_does(cfg)
    check_fused_loss(cfg)
    samples = sample_counts(cfg, glob)
    check_split_sources(cfg, samples)
    cfg.preference.check_run(micro, samples, cfg.deepspeed.stage)
    return Derived(
        world_size=world_size,
        tensor_parallel=cfg.parallel.model_parallel_size,
        pipe_parallel=cfg.parallel.pp,
        data_parallel=dp,
        micro_batch=micro,
        grad_accum=gas,
        global_batch=glob,
        precision=precision_of(cfg),
        lr_decay_iters=decay,
        warmup_iters=warmup,
        padded_vocab_size=padded,
        optimizer_type=optimizer_type(cfg),
        lr=peak_lr(cfg),
        samples=samples,
        zero_stage=cfg.deepspeed.stage,
        model=cfg.model.shape,
    )


def data_parallel_size(world_size: int, tp: int = 1, pp: int = 1) -> int:
    """world_size / (tp * pp); raises ConfigError when the ranks do not divide evenly."""
    pp = max(1, pp)  # gpt-neox reads pipe_parallel_size=0 as "no pipeline"
    if tp < 1:
        raise ConfigError(f"model_parallel_size={tp} must be >= 1")
    if world_size < 1 or world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by model_parallel_size={tp} x "
            f"pipe_parallel_size={pp} = {tp * pp}; use a world size that is a multiple of "
            f"{tp * pp}, or choose model_parallel_size x pipe_parallel_size among the divisors "
            f"of {world_size} ({divisors(world_size)})"
        )
    return world_size // (tp * pp)


def check_pipeline_clipping(cfg: NeoXConfig, precision: str) -> None:
    """DeepSpeed 0.19's fp32 pipeline path without ZeRO clips with a wrong global norm."""
    stage = cfg.deepspeed.stage
    t = cfg.training
    clip = t.clip_grad if t.clip_grad is not None else t.gradient_clipping
    if cfg.parallel.pp > 1 and precision == "fp32" and not stage and clip:
        raise ConfigError(
            f"pipe_parallel_size={cfg.parallel.pp} with fp32, ZeRO stage 0 and gradient_clipping="
            f"{clip}: DeepSpeed computes the clipping norm from stage 0's parameters only in this "
            "mode; use zero_optimization.stage 1 (or fp16/bf16), or gradient_clipping 0"
        )


def check_float8(cfg: NeoXConfig, precision: str) -> None:
    """FP8 (neox/parallel/float8.py) converts the plain model's linears: bf16 or fp32 master
    precision, no pipeline (its stages are built apart, neox/parallel/pipeline.py), and the
    output layer only where the model's own head computes the logits (no chunked loss)."""
    if not cfg.float8.fp8.enabled:
        return
    if precision == "fp16":
        raise ConfigError(
            "fp8.enabled with fp16: torchao's float8 training runs beside bf16 or fp32, not "
            "fp16 loss scaling; set bf16: {enabled: true} (precision: bfloat16)"
        )
    if cfg.parallel.pp > 1:
        raise ConfigError(
            f"fp8.enabled with pipe_parallel_size={cfg.parallel.pp}: FP8 is applied to the "
            "plain model, not to pipeline stages; use pipe_parallel_size 1 (tensor or data "
            "parallelism) or set fp8.enabled: false"
        )
    chunk = cfg.model.lm_loss_chunk_size
    if cfg.float8.fp8.output_layer and chunk:
        raise ConfigError(
            f"fp8.output_layer with lm_loss_chunk_size={chunk}: the chunked loss computes the "
            "output layer in its own bf16 matmul; set lm_loss_chunk_size: 0 or "
            "fp8.output_layer: false"
        )


def check_loss_scale(cfg: NeoXConfig, precision: str) -> None:
    """fp16's dynamic_loss_scale against a static loss scale (gpt-neox's two spellings)."""
    p = cfg.precision
    static = p.loss_scale or (p.fp16 or {}).get("loss_scale")
    if precision != "fp16":
        return
    if p.dynamic_loss_scale and static:
        raise ConfigError(
            f"dynamic_loss_scale=true contradicts a static loss_scale={static}; drop one of them"
        )
    if p.dynamic_loss_scale is False and not static:
        raise ConfigError(
            "dynamic_loss_scale=false needs a static loss scale; set loss_scale (e.g. 1024) "
            "or drop dynamic_loss_scale"
        )


def check_as_gpt_neox_does(cfg: NeoXConfig) -> None:
    """Combinations gpt-neox's own validation refuses (NeoXArgs.validate_values)."""
    lr, min_lr = peak_lr(cfg), cfg.optimizer.min_lr
    if min_lr > lr:
        raise ConfigError(
            f"min_lr={min_lr} exceeds the peak learning rate {lr}; lower min_lr or raise lr"
        )


def check_fused_loss(cfg: NeoXConfig) -> None:
    """The chunked output-layer loss runs on the plain model's whole vocabulary only."""
    chunk, tp, pp = cfg.model.lm_loss_chunk_size, cfg.parallel.model_parallel_size, cfg.parallel.pp
    if chunk < 0:
        raise ConfigError(f"lm_loss_chunk_size={chunk} must be >= 0 (0: full logits)")
    if chunk and (tp > 1 or pp > 1):
        raise ConfigError(
            f"lm_loss_chunk_size={chunk} needs model_parallel_size=1 and pipe_parallel_size=1 "
            f"(got {tp} and {pp}); set lm_loss_chunk_size 0 for this layout"
        )


def check_split_sources(cfg: NeoXConfig, samples: tuple[int, int, int]) -> None:
    """Per-split data paths cover every split the run draws samples from (gpt-neox asks for all
    three), so the ranks never find a split missing after launch."""
    d = cfg.data
    if d.data_path or not d.train_data_paths:
        return
    off = {"valid": "do_valid: false (or eval_iters: 0)", "test": "do_test: false"}
    for name, n in zip(("valid", "test"), samples[1:]):
        if n and not getattr(d, f"{name}_data_paths"):
            raise ConfigError(
                f"train_data_paths is set but {name}_data_paths is not, and the run evaluates "
                f"{n} {name} samples; add {name}_data_paths (gpt-neox requires all three) or "
                f"set {off[name]}"
            )


def check_pipeline_inputs(cfg: NeoXConfig) -> None:
    """Pipeline stages pass hidden states only: no per-document positions or masks."""
    d = cfg.data
    asked = [k for k in ("reset_position_ids", "reset_attention_mask") if getattr(d, k)]
    if cfg.parallel.pp > 1 and asked:
        raise ConfigError(
            f"{' and '.join(asked)} cannot be used with pipe_parallel_size={cfg.parallel.pp} "
            "(pipeline stages pass hidden states only); turn them off or use pipe_parallel_size 1"
        )
