"""LoRA in both engines on one rank: only the adapters train and live in the optimizer, and the
frozen base stays bit-identical, in bf16 and fp32 and with the base held in bf16."""

import pytest
import torch

from neox.config.lora import LoraConfig
from neox.model import build_model
from neox.model.transforms.lora import apply_lora, cast_lora_base
from neox.training.deepspeed_engine import DeepSpeedAdapter
from neox.training.flat_engine import FlatEngine
from neox.training.optim import param_groups
from tests.training.test_flat_engine import (  # noqa: F401  (rank: a fixture)
    CFG,
    VOCAB,
    ds_config,
    flat_settings,
    micro_batches,
    rank,
)

LORA = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.1)


def lora_engine(kind, precision, stage, base_dtype=None):
    lora = LORA.model_copy(update={"lora_base_dtype": base_dtype})
    model = build_model(CFG, VOCAB, seed=3)
    apply_lora(model, lora, None, seed=3)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    if kind == "own":
        engine = FlatEngine(
            flat_settings(precision=precision, stage=stage, accum=2), model, opt, None
        )
    else:
        engine = DeepSpeedAdapter(
            ds_config(precision=precision, stage=stage, accum=2), model, opt, None
        )
    cast_lora_base(engine.module, lora)
    return engine


def optimizer_numel(engine) -> int:
    """Elements the optimizer keeps state for (its exp_avg), whichever engine."""
    inner = engine.optimizer if kind_of(engine) == "own" else engine.ds.optimizer
    inner = getattr(inner, "optimizer", inner)  # ZeRO wraps the torch optimizer
    return sum(s["exp_avg"].numel() for s in inner.state.values())


def kind_of(engine) -> str:
    return "ds" if hasattr(engine, "ds") else "own"


@pytest.mark.parametrize(
    "kind,precision,stage,base_dtype",
    [
        ("own", "bf16", 1, None),
        ("own", "fp32", 1, "bf16"),
        ("ds", "bf16", 1, None),
        ("ds", "fp32", 0, None),
        ("ds", "fp32", 1, "bf16"),
    ],
)
def test_only_adapters_train(rank, kind, precision, stage, base_dtype):  # noqa: F811
    engine = lora_engine(kind, precision, stage, base_dtype)
    assert kind_of(engine) == kind
    module = engine.module
    base = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    adapter_numel = sum(p.numel() for p in adapters.values())
    base_numel = sum(p.numel() for p in base.values())
    if base_dtype == "bf16":
        qkv = module.layers[0].attention.query_key_value
        assert qkv.weight.dtype == torch.bfloat16 and qkv.lora_A.weight.dtype == torch.float32

    stream = micro_batches()
    steps = [engine.train_batch(stream) for _ in range(3)]
    assert all(torch.isfinite(torch.as_tensor(float(s.loss))) for s in steps)
    assert not any(bool(s.skipped) for s in steps)

    for n, p in module.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"frozen {n} changed"
            assert p.grad is None, n
    changed = [
        n for n, p in module.named_parameters() if n in adapters and not torch.equal(p, adapters[n])
    ]
    assert any(".lora_B." in n for n in changed) and any(".lora_A." in n for n in changed)
    # The optimizer holds the adapters (ZeRO pads its flat partition by a few elements) only.
    held = optimizer_numel(engine)
    assert adapter_numel <= held <= adapter_numel + 16, (held, adapter_numel)
    assert held < base_numel
