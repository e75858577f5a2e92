"""Optimizer construction: the parameters a config's optimizer section gives, gpt-neox's defaults
for what it leaves out."""

import pytest
from torch import nn

from neox.config.optimizer import OptimizerConfig
from neox.training.optim import build_optimizer


def adam(params: dict) -> dict:
    cfg = OptimizerConfig(optimizer={"type": "Adam", "params": params}, weight_decay=0.1)
    group = build_optimizer(nn.Linear(4, 4), cfg, "adam", lr=1e-3).param_groups[0]
    return group


@pytest.mark.parametrize(
    "params, betas",
    [({"lr": 1e-3}, (0.9, 0.999)), ({"lr": 1e-3, "betas": [0.9, 0.95]}, (0.9, 0.95))],
)
def test_adam_betas_are_the_configs_or_torchs_default(params, betas):
    group = adam(params)
    assert group["betas"] == betas and group["lr"] == 1e-3 and group["weight_decay"] == 0.1
