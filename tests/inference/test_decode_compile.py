"""The compiled decode step's one-row products (neox/inference/decode_compile.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from neox.inference import decode_compile
from neox.inference.decode_compile import StepKernels, decode_backend, one_row_addmm


def test_one_row_addmm_rounds_once_like_a_bias_epilogue():
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 512, generator=g).bfloat16()
    weight = torch.randn(384, 512, generator=g).bfloat16()
    bias = torch.randn(384, generator=g).bfloat16()
    got = one_row_addmm(bias, row, weight.t())
    exact = (row.double() @ weight.double().t() + bias.double()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (1, 384)
    # fp32 accumulation, one rounding: equal to the exact result rounded, but for a few ties.
    assert (got == exact).float().mean() > 0.98
    torch.testing.assert_close(got, torch.addmm(bias, row, weight.t()), rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 3])
def test_backend_writes_one_row_linears_as_reductions(monkeypatch, rows):
    """On a device where it applies (CPU admitted here), a linear of one row compiles to a
    generated reduction, not the library's addmm; more rows keep addmm. Same values either way."""
    monkeypatch.setattr(decode_compile, "GEMV_DEVICES", frozenset({"cpu"}))
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 64, generator=g)
    backend = decode_backend(StepKernels(gemv_reductions=True), {})
    fn = torch.compile(lambda x: F.gelu(F.linear(x, w, b)), backend=backend, dynamic=False)
    out, code = run_and_get_code(fn, x)
    torch.testing.assert_close(out, F.gelu(F.linear(x, w, b)), rtol=1e-5, atol=1e-5)
    uses_library = any("extern_kernels.addmm(" in c for c in code)
    assert uses_library == (rows > 1), code
    torch._dynamo.reset()


def test_backend_leaves_linears_alone_when_off(monkeypatch):
    monkeypatch.setattr(decode_compile, "GEMV_DEVICES", frozenset({"cpu"}))
    torch._dynamo.reset()
    w, b, x = torch.randn(32, 16), torch.randn(32), torch.randn(1, 16)
    off = StepKernels(gemv_reductions=False, attention_reductions=False)
    fn = torch.compile(lambda x: F.linear(x, w, b), backend=decode_backend(off, {}))
    _, code = run_and_get_code(fn, x)
    assert any("extern_kernels.addmm(" in c for c in code)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["gpt_neox_partial_dynamic_untied", "mistral_window"])
def test_attention_reductions_decode_what_sdpa_decodes(name):
    """At batch 1 the compiled step's written-out attention (a sliding window too) gives the
    eager SDPA step's tokens and logits; at batch 2 the step keeps SDPA."""
    from neox.inference.generator import Generator
    from tests.hf_family_helpers import PADDED, VOCAB, neox_pair

    _, _, model, _ = neox_pair(name)
    kernels = StepKernels(attention_reductions=True)
    for prompts in ([[(7 * i + 3) % VOCAB for i in range(20)]], [[8, 1, 50], [61, 2, 2, 70]]):
        eager = Generator(model, VOCAB, eod=PADDED - 1).generate(prompts, 24, return_logits=True)
        gen = Generator(model, VOCAB, eod=PADDED - 1, compile_step=True, step_kernels=kernels)
        gen._compiled = torch.compile(gen._decode, dynamic=False, backend="aot_eager")
        got = gen.generate(prompts, 24, return_logits=True)
        assert gen._session.cache.attention_reductions == (len(prompts) == 1)
        assert [c.tokens for c in got] == [c.tokens for c in eager]
        for a, b in zip(got, eager):
            torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combo", [True, False])
def test_backend_asks_inductor_for_combo_kernels_by_default(monkeypatch, combo):
    """A layer's independent small kernels launch as one (1.07x at 1.4B's batch-1 step on an
    H100); StepKernels(combo_kernels=False) leaves inductor's default."""
    import torch._inductor.compile_fx as compile_fx

    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None, decompositions=None):
        seen.update(config_patches)
        return gm.forward

    monkeypatch.setattr(compile_fx, "compile_fx", fake_compile_fx)
    backend = decode_backend(StepKernels(combo_kernels=combo), {"emulate_precision_casts": True})
    backend(torch.fx.symbolic_trace(torch.nn.Identity()), [torch.zeros(1)])
    assert seen.get("combo_kernels", False) is combo
    assert seen["emulate_precision_casts"] is True
