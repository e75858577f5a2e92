"""neox.kernels.adamw under Triton's interpreter (CPU) against torch's AdamW, and neox's
single-rank engine stepping through it against its torch path.

Needs TRITON_INTERPRET=1 before triton is imported: tests/kernels/test_adamw.py runs this file
in a fresh process with it set.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("adamw_interpreter_helpers.py needs TRITON_INTERPRET=1; see test_adamw.py")

import torch  # noqa: E402

from neox.kernels.adamw import adamw_step_  # noqa: E402
from neox.model import build_model  # noqa: E402
from tests.training.test_flat_engine import CFG, VOCAB, engine, train  # noqa: E402

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def reference(master, grads, scale):
    """torch.optim.AdamW on an fp32 copy, gradients divided by scale first."""
    p = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([p], **HP)
    for g in grads:
        p.grad = g.float() / scale
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("n", [5, 4096 + 3])
def test_steps_match_torch_adamw(n):
    gen = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).bfloat16() for _ in range(3)]
    scale = torch.tensor(2.5)
    want, want_state = reference(master, grads, scale)
    param, m, v = master.bfloat16(), torch.zeros(n), torch.zeros(n)
    step, ok = torch.zeros(()), torch.zeros(())
    got = master.clone()
    for g in grads:
        step += 1
        adamw_step_(param, got, g, m, v, step, scale, ok, **HP)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, want_state["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(v, want_state["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    # bf16 rounding of the interpreter may differ from the GPU's (tests/kernels/test_kernels_gpu.py checks it exactly).
    torch.testing.assert_close(param.float(), got, rtol=8e-3, atol=0)


def test_found_inf_writes_nothing():
    n = 37
    master, param = torch.randn(n), torch.randn(n).bfloat16()
    m, v = torch.randn(n), torch.rand(n)
    before = [t.clone() for t in (master, param, m, v)]
    grad = torch.full((n,), float("nan")).bfloat16()
    adamw_step_(param, master, grad, m, v, torch.ones(()), torch.ones(()), torch.ones(()), **HP)
    assert all(torch.equal(a, b) for a, b in zip(before, (master, param, m, v)))


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("bf16", 1e-2)])
def test_engine_through_the_kernel_matches_its_torch_path(precision, tol):
    """fp32 checks the arithmetic tightly; bf16 loosely, as the interpreter's bf16 rounding is
    not the GPU's."""
    model = build_model(CFG, VOCAB, seed=3)
    runs = [engine("own", model, precision=precision, accum=2) for _ in range(2)]
    assert not runs[1].one_pass  # on CPU the engine itself picks torch's fused AdamW
    runs[0].one_pass = True
    (a, na), (b, nb) = [train(e, 4, accum=2) for e in runs]
    assert a == pytest.approx(b, rel=tol) and na == pytest.approx(nb, rel=tol)
    assert max(na) > 0.05  # clipping was active
    for name, x in runs[0].module.state_dict().items():
        y = runs[1].module.state_dict()[name]
        torch.testing.assert_close(x.float(), y.float(), atol=tol, rtol=tol, msg=name)
