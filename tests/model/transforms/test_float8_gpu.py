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
    from neox.model.transforms.float8 import apply_float8
    from neox.parallel.build import compile_blocks

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
def test_compiled_float8_output_layer_and_fast_backward_train_beside_bf16():
    """fp8.output_layer and fast_accum_backward: the compiled loss graph (final norm, output
    layer, cross-entropy) runs the float8 head; training follows bf16's loss."""
    from neox.config import load_dict
    from neox.model import build_model
    from neox.model.transforms.float8 import Float8Matmul, apply_float8
    from neox.parallel.build import compile_blocks

    fp8 = {"output_layer": True, "fast_accum_backward": True, "skip_first_layers": 0}
    cfg = load_dict({**SHAPE, "fp8": {"enabled": True, **fp8}})
    ref = build_model(cfg.model, 512, seed=1, device="cuda").to(torch.bfloat16)
    model = build_model(cfg.model, 512, seed=1, device="cuda").to(torch.bfloat16)
    names = apply_float8(model, cfg.float8.resolved(), 4, "cuda")
    assert names[-1] == "head" and isinstance(model.head_linear, Float8Matmul)
    compile_blocks(model, device="cuda")
    compile_blocks(ref, device="cuda")
    fp8_losses, bf16_losses = train(model), train(ref)
    assert fp8_losses[-1] < 0.8 * fp8_losses[0]
    assert fp8_losses[-1] == pytest.approx(bf16_losses[-1], rel=0.05)


@fp8_gpu
@pytest.mark.parametrize("engine", ["flat", "deepspeed_zero2", "deepspeed_zero3"])
def test_fp8_trains_through_deepy_on_each_engine(tmp_path, engine):
    """`deepy.py train.py` with fp8 on the flat engine and DeepSpeed's (ZeRO-2, ZeRO-3): the
    loss falls, and the checkpoint holds the weights under the bf16 model's names."""
    from neox.checkpoint.find import read_latest
    from neox.checkpoint.plain_state import plain_state_dict
    from neox.config import read_saved_config
    from neox.model import build_model
    from tests.train_helpers import losses, make_dataset, run_train, write_config

    make_dataset(tmp_path / "data" / "chars", docs=400)
    zero = {"flat": 1, "deepspeed_zero2": 2, "deepspeed_zero3": 3}[engine]
    cfg = write_config(
        tmp_path,
        engine,
        num_gpus=1,
        num_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        seq_length=128,
        max_position_embeddings=128,
        train_micro_batch_size_per_gpu=8,
        gradient_accumulation_steps=1,
        train_iters=30,
        eval_interval=1000,
        checkpoint_factor=30,
        bf16={"enabled": True},
        fp8={"enabled": True},
        zero_optimization={"stage": zero},
        flat_engine=engine == "flat",
    )
    # tests/conftest.py sets DS_ACCELERATOR=cpu for the CPU tests; these ranks take the GPU.
    r = run_train(cfg, cpu=False, DS_ACCELERATOR="cuda")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    curve = losses(tmp_path / engine / "logs")
    # Random characters 1-255: the loss falls toward their entropy, ln 255 = 5.54.
    assert curve[30] < curve[1] - 0.4, curve
    # The training state by plain name (neox/checkpoint/plain_state.py), as every engine
    # writes it: the names of the same model built without fp8, finite fp32 masters.
    ckpt = tmp_path / engine / "ckpt"
    step = ckpt / read_latest(ckpt)
    state = plain_state_dict(step)
    plain = build_model(read_saved_config(step).model, 512, seed=0)
    assert set(state) == {n for n, _ in plain.named_parameters()}
    assert any(".mlp.dense_h_to_4h.weight" in k for k in state)
    assert all(torch.isfinite(v).all() for v in state.values())
