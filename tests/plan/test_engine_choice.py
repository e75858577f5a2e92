"""neox/plan/engine_choice.py: the torch-free decisions agree with what the ranks build from objects."""

import pytest
import torch

from neox.config import build_ds_config, derive, load_dict
from neox.config.model import ModelConfig
from neox.model import build_model
from neox.parallel.build import compile_blocks
from neox.plan.engine_choice import engine_for, flat_engine_unsupported, loss_path
from neox.training.flat_engine import unsupported_reason
from neox.training.optim import build_optimizer

TINY = dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16)


class SubclassedAdamW(torch.optim.AdamW):
    """Not torch's own AdamW: the flat engine leaves it to DeepSpeed."""


def ds(stage=1, precision="bf16", **zero):
    cfg = {"zero_optimization": {"stage": stage, **zero}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


# (DeepSpeed config, optimizer class, lr_scale of the second group, dp, mp, expected reason)
CASES = [
    (ds(), torch.optim.AdamW, 1.0, 1, 1, None),
    (ds(), torch.optim.AdamW, 1.0, 4, 1, None),
    (ds(precision="fp32"), torch.optim.Adam, 1.0, 2, 1, None),
    (ds(stage=0), torch.optim.AdamW, 1.0, 2, 1, None),
    (ds(), torch.optim.AdamW, 1.0, 2, 2, "tensor or pipeline parallelism"),
    (ds(precision="fp16"), torch.optim.AdamW, 1.0, 1, 1, "fp16 (loss scaling)"),
    (ds(stage=2), torch.optim.AdamW, 1.0, 1, 1, None),  # one rank: as ZeRO-1
    (ds(stage=2), torch.optim.AdamW, 1.0, 2, 1, "ZeRO-2 (gradient or weight partitioning)"),
    (ds(stage=3), torch.optim.AdamW, 1.0, 1, 1, "ZeRO-3 (gradient or weight partitioning)"),
    (ds(offload_optimizer={"device": "cpu"}), torch.optim.AdamW, 1.0, 1, 1, "ZeRO offload"),
    (ds(), torch.optim.SGD, 1.0, 1, 1, "optimizer SGD"),
    (ds(), SubclassedAdamW, 1.0, 1, 1, "optimizer SubclassedAdamW"),
    (ds(), torch.optim.AdamW, 0.5, 1, 1, "per-group learning-rate scales"),
]


@pytest.mark.parametrize("ds_config,cls,lr_scale,dp,mp,expected", CASES)
def test_config_level_decision_agrees_with_the_engines(ds_config, cls, lr_scale, dp, mp, expected):
    model = torch.nn.Linear(4, 4)
    groups = [{"params": [model.weight]}, {"params": [model.bias], "lr_scale": lr_scale}]
    optimizer = cls(groups, lr=1e-3)
    kind = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam"}.get(cls, cls.__name__)
    facts = flat_engine_unsupported(ds_config, kind, lr_scale != 1.0, dp, mp)
    assert facts == unsupported_reason(ds_config, optimizer, dp, mp) == expected


# Config overrides and world size: engine_for against unsupported_reason on the optimizer
# neox builds for that config.
CONFIGS = {
    "default": ({}, 1, "flat"),
    "dp2_zero1": ({"zero_optimization": {"stage": 1}}, 2, "flat"),
    "sgd": ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, 1, "deepspeed"),
    "dp2_zero2": ({"zero_optimization": {"stage": 2}}, 2, "deepspeed"),
    "zero3": ({"zero_optimization": {"stage": 3}}, 1, "deepspeed"),
    "fp16": ({"precision": "fp16"}, 1, "deepspeed"),
    "tp2": ({"model_parallel_size": 2}, 2, "deepspeed"),
    "cpu_offload": ({"zero_optimization": {"stage": 1, "cpu_offload": True}}, 1, "deepspeed"),
    "flat_engine_off": ({"flat_engine": False}, 1, "deepspeed"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_engine_for_a_config_is_what_build_engine_picks(name):
    overrides, world, engine = CONFIGS[name]
    cfg = load_dict({**TINY, "precision": "bfloat16", **overrides})
    derived = derive(cfg, world, 64)
    optimizer = build_optimizer(
        build_model(cfg.model, 64, seed=0), cfg.optimizer, derived.optimizer_type, derived.lr
    )
    mp = derived.tensor_parallel * derived.pipe_parallel
    real = unsupported_reason(build_ds_config(cfg, derived), optimizer, derived.data_parallel, mp)
    chosen, reason = engine_for(cfg, derived)
    assert chosen == engine
    if cfg.training.flat_engine:  # the optimizer named by its config type, or by its class
        assert (reason or "").lower() == (real or "").lower()
    else:
        assert real is None and reason == "flat_engine: false"


@pytest.mark.parametrize("chunk", [0, 8])
def test_loss_path_is_what_compile_blocks_compiles(chunk):
    model = build_model(ModelConfig(**TINY, lm_loss_chunk_size=chunk), 64, seed=0)
    compile_blocks(model, backend="eager")  # torch.compile wraps lazily: nothing compiles here
    compiled = "loss" in vars(model)  # the compiled loss replaces the bound method
    assert loss_path(True, 1, 1, chunk) == ("compiled" if compiled else "chunked")
    assert loss_path(False, 1, 1, 0) == "eager"
    assert loss_path(True, 2, 1, 0) == loss_path(True, 1, 2, 0) == "eager"
