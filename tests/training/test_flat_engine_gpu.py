"""neox's single-rank engine on a GPU: CUDA's fused AdamW (clipping through grad_scale, skipping
through found_inf) gives the CPU kernel's steps; a NaN step is skipped; resume is bit-exact."""

import pytest
import torch

from neox.checkpoint.io import save_plain_state
from neox.checkpoint.plain_state import PlainState
from neox.model import build_model
from tests.training.test_flat_engine import (  # noqa: F401  (rank: a fixture)
    CFG,
    VOCAB,
    check_non_finite_skip,
    engine,
    rank,
    train,
    weights,
)

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


@pytest.fixture(scope="module")
def cuda_model():
    return build_model(CFG, VOCAB, seed=3, device="cuda")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cuda_steps_match_the_cpu_engine(cuda_model, precision):
    gpu = engine("own", cuda_model, precision=precision, accum=2)
    cpu = engine("own", build_model(CFG, VOCAB, seed=3), precision=precision, accum=2)
    gpu_losses, gpu_norms = train(gpu, 5, accum=2)
    cpu_losses, cpu_norms = train(cpu, 5, accum=2)
    tol = 2e-2 if precision == "bf16" else 1e-4
    assert gpu_losses == pytest.approx(cpu_losses, rel=tol)
    assert gpu_norms == pytest.approx(cpu_norms, rel=tol)
    assert max(gpu_norms) > 0.05  # the test's clipping threshold was crossed


def test_cuda_non_finite_step_is_skipped(cuda_model):
    check_non_finite_skip(cuda_model)


def test_cuda_resume_is_bit_exact(cuda_model, rank, tmp_path):  # noqa: F811
    first = engine("own", cuda_model)
    train(first, 3)
    save_plain_state(first, tmp_path, {"iteration": 3})
    going_on, _ = train(first, 3, seed=1)
    second = engine("own", build_model(CFG, VOCAB, seed=77, device="cuda"))
    second.load_plain(PlainState(tmp_path), load_optimizer_states=True)
    resumed, _ = train(second, 3, seed=1)
    assert resumed == going_on
    assert all(torch.equal(a, b) for a, b in zip(weights(first).values(), weights(second).values()))


def test_cuda_kernel_rounds_params_as_torch_does():
    from neox.kernels.adamw import adamw_step_

    n = 1 << 20
    master = torch.randn(n, device="cuda")
    param, m, v = master.bfloat16(), torch.zeros_like(master), torch.zeros_like(master)
    grad = torch.randn(n, device="cuda").bfloat16()
    ones = torch.ones((), device="cuda")
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    adamw_step_(param, master, grad, m, v, ones, ones, torch.zeros_like(ones), **hp)
    assert torch.equal(param, master.bfloat16())
