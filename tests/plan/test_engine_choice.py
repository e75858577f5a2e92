"""neox/plan/engine_choice.py: the torch-free decision, and the ranks building what it names."""

import pytest

from neox.config import derive, load_dict
from neox.config.model import ModelConfig
from neox.model import build_model
from neox.parallel.build import compile_blocks
from neox.plan.engine_choice import (
    ZERO3_ONE_RANK_NOTE,
    choose_engine,
    engine_for,
    flat_engine_unsupported,
    loss_path,
    overlaps_reduction,
)
from tests.training.test_flat_engine import rank  # noqa: F401  (one gloo rank, a fixture)

TINY = dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16)


def ds(stage=1, precision="bf16", **zero):
    cfg = {"zero_optimization": {"stage": stage, **zero}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


# (DeepSpeed config, optimizer type, dp, mp, expected reason)
CASES = [
    (ds(), "adamw", 1, 1, None),
    (ds(), "adamw", 4, 1, None),
    (ds(precision="fp32"), "adam", 2, 1, None),
    (ds(stage=0), "adamw", 2, 1, None),
    (ds(), "adamw", 2, 2, "tensor or pipeline parallelism"),
    (ds(precision="fp16"), "adamw", 1, 1, "fp16 (loss scaling)"),
    (ds(stage=2), "adamw", 1, 1, None),  # one rank: as ZeRO-1
    (ds(stage=2), "adamw", 2, 1, "ZeRO-2 (gradient or weight partitioning)"),
    (ds(stage=3), "adamw", 1, 1, "ZeRO-3 (gradient or weight partitioning)"),
    (ds(offload_optimizer={"device": "cpu"}), "adamw", 1, 1, "ZeRO offload"),
    (ds(), "sgd", 1, 1, "optimizer sgd"),
    (ds(reduce_bucket_size=10, overlap_comm=True), "adamw", 2, 1, None),  # read: buckets
    (ds(round_robin_gradients=True), "adamw", 2, 1, "zero_optimization.round_robin_gradients"),
    ({**ds(), "wall_clock_breakdown": True}, "adamw", 1, 1, None),
    ({**ds(), "prescale_gradients": True}, "adamw", 1, 1, "prescale_gradients: true"),
    ({**ds(), "memory_breakdown": True}, "adamw", 1, 1, "DeepSpeed key memory_breakdown"),
]


@pytest.mark.parametrize("ds_config,kind,dp,mp,expected", CASES)
def test_what_the_flat_engine_does_not_cover_goes_to_deepspeed(ds_config, kind, dp, mp, expected):
    assert flat_engine_unsupported(ds_config, kind, dp, mp) == expected


@pytest.mark.parametrize(
    "zero,dp,mp,noted",
    [
        ({}, 1, 1, True),
        ({}, 2, 1, False),  # partitions across the two ranks
        ({}, 1, 2, False),  # tensor parallel: stage 1 would not run on the flat engine either
        ({"offload_param": {"device": "cpu"}}, 1, 1, False),  # frees GPU memory
    ],
)
def test_zero3_at_one_rank_says_it_partitions_nothing(zero, dp, mp, noted):
    choice = choose_engine(ds(stage=3, **zero), "adamw", dp, mp)
    assert (ZERO3_ONE_RANK_NOTE in choice.describe()) is noted
    assert choose_engine(ds(stage=1), "adamw", 1, 1).note is None


@pytest.mark.parametrize(
    "overlap,comm,precision,ranks,why_not",
    [
        (True, None, "bf16", 2, None),
        (True, "bf16", "bf16", 4, None),
        (True, "fp32", "fp32", 2, None),
        (False, None, "bf16", 2, "overlap_comm off"),
        (True, None, "bf16", 1, "one data-parallel rank"),
        (True, "fp32", "bf16", 2, "communication in fp32, not the gradients' bf16"),
    ],
)
def test_the_flat_engine_overlaps_its_reduction_only_in_the_gradients_dtype(
    overlap, comm, precision, ranks, why_not
):
    assert overlaps_reduction(overlap, comm, precision, ranks) == why_not


def test_the_engine_line_says_when_gradients_are_reduced():
    """Across ranks, the dry run's engine line says whether the flat engine reduces gradients
    during the backward (overlap_comm) or after it, and why; on one rank it says nothing."""
    from neox.plan.report import describe_engines

    def line(world, **overrides):
        cfg = load_dict({**TINY, "precision": "bfloat16", **overrides})
        return describe_engines(cfg, derive(cfg, world, 64), 64)

    overlap = {"zero_optimization": {"stage": 1, "overlap_comm": True}}
    assert line(2, **overlap).endswith(  # TINY's 15k parameters
        "; gradients: reduce-scattered after the backward (the model fits one bucket of "
        "500,000,000)"
    )
    big = dict(overlap, num_layers=24, hidden_size=2048, num_attention_heads=16)
    assert line(2, **big).endswith(
        "; gradients: all-reduced during the backward in buckets of up to 500,000,000 elements "
        "(overlap_comm)"
    )
    assert line(2, zero_reduce_bucket_size=1000, **overlap).endswith(
        "up to 1,000 elements (overlap_comm)"
    )
    assert line(2).endswith("; gradients: reduce-scattered after the backward (overlap_comm off)")
    assert line(2, fp32_allreduce=True, **overlap).endswith(
        "after the backward (communication in fp32, not the gradients' bf16)"
    )
    assert "gradients:" not in line(1, **overlap)
    assert "gradients:" not in line(2, model_parallel_size=2, **overlap)  # DeepSpeed's engine


# Config overrides, world size, the engine and the optimizer class the ranks must build.
CONFIGS = {
    "default": ({}, 1, "flat", "AdamW"),
    "sgd": ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, 1, "deepspeed", "SGD"),
    "zero3": ({"zero_optimization": {"stage": 3}}, 1, "deepspeed", "AdamW"),
    "cpu_offload": (
        {"zero_optimization": {"stage": 1, "cpu_offload": True}},
        1,
        "deepspeed",
        "DeepSpeedCPUAdam",
    ),
    "flat_engine_off": ({"flat_engine": False}, 1, "deepspeed", "AdamW"),
    "wall_clock": ({"wall_clock_breakdown": True}, 1, "flat", "AdamW"),
}


@pytest.mark.usefixtures("rank")
@pytest.mark.parametrize("name", CONFIGS)
def test_ranks_build_the_engine_the_plan_names(name):
    """setup.make_engine (what build_run calls) on a one-rank gloo group builds the engine
    engine_for names, stepping the optimizer it names; the engine line says the same."""
    from neox.plan.report import describe_engines
    from neox.training.deepspeed_engine import DeepSpeedAdapter
    from neox.training.flat_engine import FlatEngine
    from neox.training.setup import make_engine

    overrides, world, expected, optimizer = CONFIGS[name]
    cfg = load_dict({**TINY, "precision": "bfloat16", **overrides})
    derived = derive(cfg, world, 64)
    choice = engine_for(cfg, derived)
    assert choice.engine == expected
    model = build_model(cfg.model, 64, seed=0)
    engine = make_engine(cfg, derived, model, None)
    assert isinstance(engine, FlatEngine if expected == "flat" else DeepSpeedAdapter)
    inner = engine.optimizer if expected == "flat" else engine.ds.basic_optimizer
    assert type(inner).__name__ == optimizer
    line = describe_engines(cfg, derived, 64)
    assert ("CPU Adam" in line) == (optimizer == "DeepSpeedCPUAdam")
    if isinstance(engine, DeepSpeedAdapter):
        engine.destroy()


@pytest.mark.parametrize("chunk", [0, 8])
def test_loss_path_is_what_compile_blocks_compiles(chunk):
    model = build_model(ModelConfig(**TINY, lm_loss_chunk_size=chunk), 64, seed=0)
    compile_blocks(model, backend="eager")  # torch.compile wraps lazily: nothing compiles here
    compiled = "loss" in vars(model)  # the compiled loss replaces the bound method
    assert loss_path(True, chunk) == ("compiled" if compiled else "chunked")
    assert loss_path(False, 0) == "eager"
