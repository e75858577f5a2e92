"""Values computed from the config, never read from YAML: layout, batch triple, vocab,
schedule, precision. Everything else reads them from here rather than working them out again
(the model's own shape is `ModelConfig.shape`, neox/config/shape.py).

Rules live with the groups that own their keys: a group checks its own keys when validated,
NeoXConfig the rules that read several groups, and `derive` hands the values it computes to
`NeoXConfig.check_run` for the rules that need them. The schema is imported for type hints
only."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

from neox.config.errors import ConfigError
from neox.config.optimizer import OPTIMIZER_TYPES
from neox.config.parallel import check_model_split, divisors
from neox.config.shape import ModelShape

if TYPE_CHECKING:
    from neox.config.schema import NeoXConfig


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
    """fp16, bf16 or fp32, from the DeepSpeed sections or gpt-neox's `precision`. An fp16
    section of `type: bfloat16` is gpt-neox's way of asking for bf16 (configs/pythia/1B.yml)."""
    p = cfg.precision
    fp16 = bool(p.fp16 and p.fp16.get("enabled", True))
    bf16 = bool(p.bf16 and p.bf16.get("enabled", True))
    if fp16 and p.fp16.get("type") in ("bfloat16", "bf16"):
        fp16, bf16 = False, True
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
    cfg.model.check_expert_parallel(dp)
    micro, gas, glob = batch_triple(cfg, dp)
    decay, warmup = schedule_iters(cfg)
    padded = padded_vocab(cfg, vocab_size)
    samples = sample_counts(cfg, glob)
    cfg.check_run(precision_of(cfg), peak_lr(cfg), micro, samples)
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
