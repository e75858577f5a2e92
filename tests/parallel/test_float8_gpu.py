"""FP8 on an H100-class GPU: real float8 matmuls (torch._scaled_mm) in the chosen linears,
compiled blocks, both engines through build_run, training beside bf16."""

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
pytest.importorskip("torchao.float8")
fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs float8 tensor cores (compute capability 8.9+)",
)

SHAPE = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    seq_length=256,
    max_position_embeddings=256,
    pos_emb="rotary",
    rotary_pct=0.25,
    gpt_j_residual=True,
    bf16={"enabled": True},
)


def train(model, steps=30, lr=1e-3):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (8, 257), generator=g).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    losses = []
    for _ in range(steps):
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@fp8_gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_float8_blocks_train_beside_bf16(recipe):
    from torchao.float8.float8_linear import Float8Linear

    from neox.config import load_dict
    from neox.model import build_model
    from neox.parallel.build import compile_blocks
    from neox.parallel.float8 import apply_float8

    cfg = load_dict({**SHAPE, "fp8": {"enabled": True, "recipe": recipe}})
    ref = build_model(cfg.model, 512, seed=1, device="cuda").to(torch.bfloat16)
    model = build_model(cfg.model, 512, seed=1, device="cuda").to(torch.bfloat16)
    names = apply_float8(model, cfg.float8.resolved(), 4, "cuda")
    assert len(names) == 8 and all(isinstance(model.get_submodule(n), Float8Linear) for n in names)
    compile_blocks(model, device="cuda")
    compile_blocks(ref, device="cuda")
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    with torch.no_grad():
        a, b = model(ids), ref(ids)
    assert not torch.equal(a, b)  # float8 rounding shows: the float8 path ran
    assert torch.allclose(a.float(), b.float(), atol=0.1, rtol=0.1)
    fp8, bf16 = train(model), train(ref)
    assert fp8[-1] < 0.8 * fp8[0]
    assert fp8[-1] == pytest.approx(bf16[-1], rel=0.05)
    assert all(p.dtype == torch.bfloat16 for p in model.state_dict().values())


@fp8_gpu
@pytest.mark.parametrize("engine", ["flat", "deepspeed_zero2", "deepspeed_zero3"])
def test_fp8_runs_through_build_run_on_each_engine(engine):
    from neox.config import load_dict
    from neox.training.loop import train_step
    from neox.training.setup import build_run

    zero = {"flat": 1, "deepspeed_zero2": 2, "deepspeed_zero3": 3}[engine]
    cfg = load_dict(
        {
            **SHAPE,
            "fp8": {"enabled": True},
            "tokenizer_type": "CharLevelTokenizer",
            "train_micro_batch_size_per_gpu": 4,
            "train_iters": 10,
            "zero_optimization": {"stage": zero},
            "flat_engine": engine == "flat",
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        }
    )
    run = build_run(cfg)
    assert type(run.engine).__name__ == ("FlatEngine" if engine == "flat" else "DeepSpeedAdapter")
    module = getattr(run.engine, "module", None) or run.engine.ds.module
    kinds = {type(m).__name__ for m in module.modules()}
    assert "Float8Linear" in kinds
    g = torch.Generator().manual_seed(0)
    batches = [{"text": torch.randint(0, 200, (4, 257), generator=g).cuda()} for _ in range(2)]
    stream = iter(batches * 5)
    losses = [float(train_step(run, stream, i).read()["loss"]) for i in range(8)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    run.engine.destroy() if hasattr(run.engine, "destroy") else None
