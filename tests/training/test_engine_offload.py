"""ZeRO-Offload with the config's own Adam: the ranks build DeepSpeed's CPU Adam with the
config's hyperparameters and step with it; the dry run's engine line says so."""

import pytest
import torch

from neox.config import derive, load_dict
from neox.config.errors import ConfigError
from neox.model import build_model
from neox.plan.engine_choice import engine_for
from neox.plan.report import describe_engines
from tests.training.test_flat_engine import micro_batches, rank  # noqa: F401  (a fixture)

VOCAB = 64


def offload_config(kind="Adam", stage=1, **params):
    return load_dict(
        {
            "num_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "seq_length": 16,
            "max_position_embeddings": 16,
            "precision": "bfloat16",
            "train_micro_batch_size_per_gpu": 2,
            "weight_decay": 0.05,
            "optimizer": {"type": kind, "params": {"lr": 2e-3, **params}},
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
        }
    )


def cpu_adam_builds() -> bool:
    from deepspeed.ops.op_builder import CPUAdamBuilder

    return CPUAdamBuilder().is_compatible(verbose=False)


@pytest.mark.usefixtures("rank")
@pytest.mark.parametrize("kind, stage", [("Adam", 1), ("AdamW", 1), ("Adam", 2)])
def test_offload_steps_with_deepspeeds_cpu_adam(kind, stage):
    if not cpu_adam_builds():
        pytest.skip("DeepSpeed's CPU Adam (a C++ op built on first use) cannot build here")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from neox.training.setup import make_engine

    cfg = offload_config(kind, stage, betas=[0.8, 0.9], eps=1e-6)
    derived = derive(cfg, 1, VOCAB)
    choice = engine_for(cfg, derived)
    assert (choice.engine, choice.optimizer, choice.adamw_mode) == ("deepspeed", "cpu_adam", True)
    line = describe_engines(cfg, derived, VOCAB)
    assert "DeepSpeed's CPU Adam for zero_optimization.offload_optimizer" in line
    model = build_model(cfg.model, VOCAB, seed=0)
    engine = make_engine(cfg, derived, model, None)
    try:
        adam = engine.ds.basic_optimizer
        assert isinstance(adam, DeepSpeedCPUAdam) and adam.adam_w_mode
        for group in adam.param_groups:
            assert group["lr"] == 2e-3 and tuple(group["betas"]) == (0.8, 0.9)
            assert group["eps"] == 1e-6
        assert sorted(g["weight_decay"] for g in adam.param_groups) == [0.0, 0.05]
        before = [p.detach().float().clone() for p in engine.module.parameters()]
        step = engine.train_batch(micro_batches())
        assert torch.isfinite(step.loss) and not step.skipped
        after = [p.detach().float() for p in engine.module.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(before, after))  # it stepped
        assert engine.ds.global_steps == 1
    finally:
        engine.destroy()


def test_offload_with_another_optimizer_is_refused_by_name():
    cfg = offload_config("SGD")
    with pytest.raises(ConfigError, match="offload_optimizer.*SGD|offload_optimizer.*sgd"):
        engine_for(cfg, derive(cfg, 1, VOCAB))


def test_offload_at_zero_0_is_refused_by_name():
    """DeepSpeed offloads a ZeRO partition: at stage 0 there is none (and it would die)."""
    cfg = offload_config(stage=0)
    with pytest.raises(ConfigError, match="offload_optimizer.*stage"):
        engine_for(cfg, derive(cfg, 1, VOCAB))
