"""ZeRO-3 through DeepSpeed's engine, with compiled blocks as neox builds them: neox's ZeRO-3
defaults (neox.config.ds_config.ZERO3_DEFAULTS) keep each block one graph, train as the flat
engine does on one rank, and still release every gathered weight between forward and backward
on two."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from neox.config.ds_config import ZERO3_DEFAULTS
from neox.model import build_model
from neox.training.deepspeed_engine import DeepSpeedAdapter
from neox.training.flat_engine import FlatEngine
from neox.training.optim import param_groups
from tests.parallel.rank_helpers import run_ranks
from tests.training.test_flat_engine import (  # noqa: F401  (rank: a fixture)
    CFG,
    VOCAB,
    ds_config,
    flat_settings,
    rank,
    train,
)
from tests.training.zero3_release_helpers import CASES, run_cases

DEEPSPEED_DEFAULTS = {"leaf_module": {"classes": []}}


def zero3_engine(zero: dict, compiled: bool = True):
    """DeepSpeed's ZeRO-3 engine (fp32) over a model whose blocks are torch.compile'd first, as
    neox/parallel/build.py compile_blocks does, on a backend that needs no C compiler."""
    model = copy.deepcopy(build_model(CFG, VOCAB, seed=3))
    if compiled:
        for block in model.layers:
            block.forward = torch.compile(block.forward, backend="aot_eager")
    cfg = ds_config(precision="fp32", stage=3)
    cfg["zero_optimization"].update(zero)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    return DeepSpeedAdapter(cfg, model, opt, None)


@pytest.fixture
def restore_linear():
    """DeepSpeed's memory-efficient linear replaces torch.nn.functional.linear for the process."""
    linear = F.linear
    yield
    F.linear = linear


@pytest.mark.parametrize("zero,breaks", [(ZERO3_DEFAULTS, False), (DEEPSPEED_DEFAULTS, True)])
def test_compiled_blocks_stay_whole_under_neox_zero3_defaults(
    rank,  # noqa: F811
    restore_linear,
    zero,
    breaks,
):
    torch._dynamo.reset()
    counters.clear()
    engine = zero3_engine(zero)
    try:
        assert engine.partitions_weights()
        train(engine.ds, 2)
    finally:
        engine.destroy()
    # DeepSpeed's per-module hooks are compiler.disable'd: each is a graph break in a block.
    assert (sum(counters["graph_break"].values()) > 0) is breaks, dict(counters["graph_break"])


def test_zero3_trains_as_the_flat_engine_does(rank):  # noqa: F811
    engine = zero3_engine(ZERO3_DEFAULTS)
    try:
        ds_losses, ds_norms = train(engine.ds, 4)
    finally:
        engine.destroy()
    model = build_model(CFG, VOCAB, seed=3)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    flat = FlatEngine(flat_settings(precision="fp32", stage=1), model, opt, None)
    own_losses, own_norms = train(flat, 4)
    assert ds_losses == pytest.approx(own_losses, rel=1e-5)
    assert ds_norms == pytest.approx(own_norms, rel=1e-5)


def test_gathered_weights_are_released_before_backward(tmp_path):
    """With torch's own linear an eager layer saves a view of its gathered weight: the control
    case holds weights past the forward, neox's defaults (compiled or eager) hold none."""
    run_ranks(run_cases, 2, list(CASES), str(tmp_path))
    held = json.loads((tmp_path / "held.json").read_text())
    assert held["torch_linear_eager"] > 0, held
    assert held["neox_compiled"] == held["neox_eager"] == 0, held
