"""The public wrapper: its Triton path (through the interpreter, in a fresh process), its
fallback to the torch reference, and its input errors."""

from pathlib import Path

import pytest
import torch

from neox.kernels.fused_softmax import (
    CONFIG_ENV,
    KernelConfig,
    candidate_configs,
    default_config,
    fused_scaled_masked_softmax,
    scaled_masked_softmax,
    triton_available,
)
from neox.kernels.softmax_reference import scaled_masked_softmax_reference
from tests.kernels.interpreter_helpers import run_interpreter_cases

INTERPRETER_CASES = Path(__file__).with_name("softmax_interpreter_helpers.py")


def test_triton_kernels_under_interpreter_match_float64_reference():
    """Runs softmax_interpreter_helpers.py where TRITON_INTERPRET=1 precedes the triton import."""
    run_interpreter_cases(INTERPRETER_CASES)


def make_key_padding(b: int, sk: int) -> torch.Tensor:
    mask = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
    mask[0, ..., sk // 2 :] = True
    return mask


def test_fallback_without_interpreter_matches_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(4)
    scores = torch.randn(2, 2, 5, 8, requires_grad=True)
    mask = make_key_padding(2, 8)
    assert not triton_available(scores)
    probs = scaled_masked_softmax(scores, 0.4, causal=True, padding_mask=mask)
    want = scaled_masked_softmax_reference(scores, 0.4, causal=True, padding_mask=mask)
    assert torch.equal(probs, want)
    grad_out = torch.randn_like(probs)
    (got_grad,) = torch.autograd.grad(probs, scores, grad_out)
    (want_grad,) = torch.autograd.grad(want, scores, grad_out)
    assert torch.equal(got_grad, want_grad)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_scaled_masked_softmax(scores, 0.4)


def test_interpreter_flag_set_after_triton_import_falls_back(monkeypatch):
    triton_language = pytest.importorskip("triton.language", reason="triton is not installed")
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(triton_language.max, InterpretedFunction):
        pytest.skip("this process imported triton with TRITON_INTERPRET=1 already set")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    scores = torch.randn(1, 2, 4, 4)
    assert not triton_available(scores)
    assert torch.equal(
        scaled_masked_softmax(scores, 1.0), scaled_masked_softmax_reference(scores, 1.0, True)
    )


def test_bad_inputs_name_the_fix():
    scores = torch.randn(2, 2, 4, 4)
    with pytest.raises(ValueError, match="4-D"):
        scaled_masked_softmax(torch.randn(4, 4), 1.0)
    with pytest.raises(TypeError, match="bool"):
        scaled_masked_softmax(scores, 1.0, padding_mask=torch.zeros(2, 1, 1, 4))
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_masked_softmax(scores, 1.0, padding_mask=torch.zeros(3, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="power of two"):
        fused_scaled_masked_softmax(scores, 1.0, block_size=6)


def test_launch_config_defaults_and_override(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    # Short rows share a program; every default keeps 16 elements per thread.
    assert default_config(1024) == KernelConfig(rows=2, num_warps=4)
    assert default_config(4096) == KernelConfig(rows=1, num_warps=8)
    assert default_config(2048) in candidate_configs(2048)
    monkeypatch.setenv(CONFIG_ENV, "rows=4, warps=8")
    assert default_config(2048) == KernelConfig(rows=4, num_warps=8)
    for bad in ("rows=3,warps=4", "rows=1", "warps=4,rows=1,x=2", "rows=a,warps=4"):
        monkeypatch.setenv(CONFIG_ENV, bad)
        with pytest.raises(ValueError, match="rows=R,warps=W"):
            default_config(2048)
