"""Everything a rank builds before the first step: process groups, tokenizer, model, engine, data."""

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from neox.adapters.load_base import load_lora_base
from neox.config import Derived, NeoXConfig, build_ds_config, derive
from neox.config.ds_config import activation_checkpointing_section
from neox.data.loader import DataLoaders, ReadPlan, build_train_valid_test_loaders
from neox.data.pairs import build_preference_loaders
from neox.model.transforms.lora import apply_lora, cast_lora_base
from neox.parallel.distributed import init_distributed
from neox.plan.engine_choice import EngineChoice, engine_for, torch_compile_enabled
from neox.tokenizer import Tokenizer, build_tokenizer
from neox.training.deepspeed_engine import DeepSpeedAdapter
from neox.training.engine import Engine, LossFn, forward_loss
from neox.training.flat_engine import FlatEngine, FlatSettings
from neox.training.optim import build_optimizer
from neox.training.preference import (
    Objective,
    attach_reward_head,
    build_objective,
    needs_reference,
)
from neox.training.schedule import LRSchedule

log = logging.getLogger(__name__)


@dataclass
class Run:
    """The live objects of one rank's training run."""

    cfg: NeoXConfig
    derived: Derived
    tokenizer: Tokenizer
    engine: Engine
    schedule: LRSchedule
    device: torch.device
    rank: int
    dp_rank: int
    groups: Any  # neox.parallel.ProcessGroups
    # Kept in checkpoints, so a resumed run goes on counting.
    counters: dict[str, int] = field(
        default_factory=lambda: {
            "skipped_steps": 0,
            "nonfinite_steps": 0,
            "consumed_trained_tokens": 0,  # the loss masks' sums, summed over the steps
        }
    )
    # train_impl dpo/kto/rm: its batch, loss and metrics (neox/training/preference.py).
    objective: Optional[Objective] = None

    @property
    def is_logging_rank(self) -> bool:
        # DeepSpeed's pipeline engine broadcasts the loss to every stage, so rank 0 knows it too.
        return self.rank == 0


def build_run(cfg: NeoXConfig) -> Run:
    """Tokenizer, derived values, the parallel model inside its engine, and the schedule."""
    from neox.parallel.build import engine_mpu, parallelize
    from neox.parallel.topology import ProcessGroups, Topology

    device = init_distributed(cfg)
    world = torch.distributed.get_world_size()
    t = cfg.tokenizer
    tokenizer = build_tokenizer(t.tokenizer_type, t.vocab_file, t.merge_file)
    derived = derive(cfg, world, tokenizer.vocab_size)
    groups = ProcessGroups(
        Topology(
            derived.tensor_parallel,
            derived.pipe_parallel,
            derived.data_parallel,
            derived.context_parallel,
        ),
        sequence_parallel=cfg.parallel.splits_sequence,
    )
    tr = cfg.training

    def build_model(checkpointing: bool) -> nn.Module:
        return parallelize(
            cfg.model,
            derived.padded_vocab_size,
            groups,
            tr.seed,
            checkpoint_activations=checkpointing and tr.checkpoint_activations,
            checkpoint_num_layers=tr.checkpoint_num_layers,
            checkpointing_options=activation_checkpointing_section(cfg),
            torch_compile=torch_compile_enabled(tr.torch_compile, device.type),
            torch_compile_backend=tr.torch_compile_backend,
            activation_memory_budget=tr.activation_memory_budget,
            pipe_partition_method=cfg.parallel.pipe_partition_method,
            device=device,
            float8=cfg.float8.resolved(),
            context_parallel_chunks=cfg.parallel.context_parallel_chunks,
        )

    model = build_model(checkpointing=True)
    if cfg.lora.lora_rank:
        add_lora(model, cfg, groups, derived.padded_vocab_size)
    objective = preference_objective(cfg, derived, groups, model, build_model)
    engine = make_engine(cfg, derived, model, engine_mpu(model, groups), objective)
    if cfg.lora.lora_rank:
        cast_lora_base(model, cfg.lora)  # after the engine's own cast to the training precision
    o = cfg.optimizer
    schedule = LRSchedule(
        peak_lr=derived.lr,
        min_lr=o.min_lr,
        warmup_iters=derived.warmup_iters,
        decay_iters=derived.lr_decay_iters,
        style=o.lr_decay_style,
    )
    return Run(
        cfg=cfg,
        derived=derived,
        tokenizer=tokenizer,
        engine=engine,
        schedule=schedule,
        device=device,
        rank=torch.distributed.get_rank(),
        dp_rank=groups.coord.data,  # the samples it reads (context-parallel peers share them)
        groups=groups,
        objective=objective,
    )


def preference_objective(
    cfg: NeoXConfig, derived: Derived, groups: Any, model: nn.Module, build_model: Any
) -> Optional[Objective]:
    """train_impl's Objective: for rm the model's output layer becomes the reward head; for
    DPO/KTO a second, frozen model holds the reference weights (filled in at Objective.start)."""
    p = cfg.preference
    if p.train_impl == "normal":
        return None
    tp_group = groups.tensor if derived.tensor_parallel > 1 else None
    if p.train_impl == "rm":
        attach_reward_head(model, cfg.training.seed, tp_group)
    reference = None
    if needs_reference(cfg):
        # In the training dtype at once: never a second set of fp32 weights (the engines cast
        # the policy to it too; Objective.start copies the policy's weights in).
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(derived.precision)
        reference = build_model(checkpointing=False).to(dtype or torch.float32)
    return build_objective(cfg, tp_group, reference)


def add_lora(model: nn.Module, cfg: NeoXConfig, groups: Any, padded_vocab_size: int) -> None:
    """The base's weights from lora_base, then adapters on the target linears, base frozen:
    the optimizer (param_groups takes trainable parameters only) holds the adapters alone."""
    load_lora_base(model, cfg, groups, padded_vocab_size)
    names = apply_lora(model, cfg.lora, groups, cfg.training.seed)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA rank %d on %d linears: %d of %d parameters on this rank train (%.3f%%)",
        cfg.lora.lora_rank,
        len(names),
        trained,
        total,
        100 * trained / total,
    )


def make_engine(
    cfg: NeoXConfig,
    derived: Derived,
    model: torch.nn.Module,
    mpu: Any,
    loss_fn: Optional[LossFn] = None,
) -> Engine:
    """The engine and optimizer neox.plan.engine_choice.engine_for names for this config: the
    same decision the dry run and the memory estimate report. loss_fn: a train_impl's
    Objective (default: the language-model loss)."""
    choice = engine_for(cfg, derived)
    optimizer = build_optimizer(
        model, cfg.optimizer, choice.optimizer, derived.lr, choice.adamw_mode
    )
    return build_engine(choice, cfg, derived, model, optimizer, mpu, loss_fn or forward_loss)


def build_data(
    run: Run, consumed_train_samples: int, consumed_valid_samples: int = 0
) -> DataLoaders:
    """Sample streams sized for the whole run, starting where a resumed run left off."""
    d = run.derived
    read = ReadPlan(
        num_samples=d.samples,
        micro_batch_size=d.micro_batch,
        data_parallel_rank=run.dp_rank,
        data_parallel_size=d.data_parallel,
        consumed_train_samples=consumed_train_samples,
        consumed_valid_samples=consumed_valid_samples,
        pin_memory=run.device.type == "cuda",
    )
    if run.objective is not None:
        return build_preference_loaders(run.cfg, read)
    return build_train_valid_test_loaders(run.cfg, read, vocab_size=d.padded_vocab_size)


def build_engine(
    choice: EngineChoice,
    cfg: NeoXConfig,
    derived: Derived,
    model: nn.Module,
    optimizer: Any,
    mpu: Any,
    loss_fn: LossFn = forward_loss,
) -> Engine:
    """The engine `choice` names (neox.plan.engine_choice.choose_engine), stepping `optimizer`
    and computing each micro-batch's loss with `loss_fn`. The flat engine reads neox's config;
    DeepSpeed's JSON is built for DeepSpeed's engine alone."""
    if choice.engine == "flat":
        log.info("neox's flat engine (flat_engine: false for DeepSpeed's)")
        return FlatEngine(FlatSettings.of(cfg, derived), model, optimizer, mpu, loss_fn)
    log.info("engine: %s", choice.describe())
    return DeepSpeedAdapter(build_ds_config(cfg, derived), model, optimizer, mpu, loss_fn)
