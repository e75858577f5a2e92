"""ZeRO-3 on gloo ranks: how many bytes of gathered weights the forward leaves referenced by
saved tensors (views of a gathered weight keep it whole until backward). Run by
tests/training/test_zero3.py."""

import json
from pathlib import Path

import torch
from torch import nn

from neox.config.ds_config import ZERO3_DEFAULTS
from neox.model import build_model
from neox.training.deepspeed_engine import DeepSpeedAdapter
from neox.training.optim import param_groups
from tests.training.test_flat_engine import CFG, VOCAB, batches, ds_config

# Release every weight after its use: no reuse window, no prefetch, nothing kept whole.
RELEASE = {
    "stage3_max_reuse_distance": 0,
    "stage3_max_live_parameters": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_param_persistence_threshold": 0,
}
# The control first: DeepSpeed's memory-efficient linear, once on, stays in torch.nn.functional.
CASES = {
    "torch_linear_eager": ({**ZERO3_DEFAULTS, "memory_efficient_linear": False}, False),
    "neox_compiled": (ZERO3_DEFAULTS, True),
    "neox_eager": (ZERO3_DEFAULTS, False),
}


def held_bytes(zero: dict, compiled: bool, world: int) -> int:
    model = build_model(CFG, VOCAB, seed=3)
    if compiled:
        for block in model.layers:
            block.forward = torch.compile(block.forward, backend="aot_eager")
    cfg = ds_config(precision="fp32", stage=3)
    cfg["train_batch_size"] = 2 * world
    cfg["zero_optimization"].update({**RELEASE, **zero})
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    engine = DeepSpeedAdapter(cfg, model, opt, None)
    params = list(engine.module.parameters())
    held = 0
    try:
        for tokens, labels in batches(2):
            views = []

            def pack(t: torch.Tensor, views: list = views) -> torch.Tensor:
                # A tensor sharing a gathered weight's storage that is not the parameter itself.
                live = {p.data.untyped_storage().data_ptr() for p in params if p.data.numel()}
                if t.untyped_storage().data_ptr() in live and not isinstance(t, nn.Parameter):
                    views.append(t)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = engine.ds(tokens, labels=labels)
            # After the forward ZeRO-3 has released every weight; a saved view still holds it.
            held = sum(
                {
                    t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in views
                }.values()
            )
            engine.ds.backward(loss)
            engine.ds.step()
    finally:
        engine.destroy()
    return held


def run_cases(rank: int, world: int, names: list[str], out: str) -> None:
    result = {name: held_bytes(*CASES[name], world) for name in names}
    if rank == 0:
        Path(out, "held.json").write_text(json.dumps(result))
