"""neox.kernels.decode and the fused decode step (neox.inference.fused_step) under Triton's
interpreter (CPU): in fp32 the fused step gives the eager step's greedy tokens and logits for
every model family it takes (transformers' families: partial rotary, GQA/MQA, sliding windows,
YaRN and linear RoPE, biases, tied heads), at batch 1, 2 and 4 with left padding, and writes the
same cache; each kernel's arithmetic is the eager rounding sequence in bf16.

Needs TRITON_INTERPRET=1 before triton is imported: tests/kernels/test_decode_kernels.py runs
this file in a fresh process with it set.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("decode_interpreter_helpers.py needs TRITON_INTERPRET=1; see its runner")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from neox.inference.fused_step import FusedStep  # noqa: E402
from neox.inference.generator import Generator  # noqa: E402
from neox.inference.sampling import SamplingParams  # noqa: E402
from neox.kernels.decode import (  # noqa: E402
    LinearPart,
    cached_attention,
    linear_residual,
    norm_linear,
)
from tests.hf_family_helpers import FAMILIES, PADDED, VOCAB, neox_pair  # noqa: E402
from tests.inference.test_generator import tiny_pair  # noqa: E402

PROMPTS = [[(7 * i + 3) % VOCAB for i in range(20)], [8, 1, 50], [61, 2, 2, 70, 33], [4]]
# Each interpreted step costs seconds. The greedy rows: two end after their second token, the
# other two run on past them (the ended rows must stay ended).
NEW = 4
# The prefill, then two fused steps (the second reads a slot the first wrote) at positions 20-22
# of the longest row: past every window and original RoPE length of the families.
COMPARED = 3


def both(model, prompts, new=COMPARED):
    eager = Generator(model, VOCAB, eod=PADDED - 1)
    fused = Generator(model, VOCAB, eod=PADDED - 1, fused_step=True)
    assert fused.fused_for(len(prompts))
    a = eager.generate(prompts, new, return_logits=True)
    b = fused.generate(prompts, new, return_logits=True)
    return a, b, eager, fused


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_step_equals_the_eager_step_for_each_family(name):
    _, cfg, model, _ = neox_pair(name)
    problem = FusedStep.unsupported(model)
    dynamic = cfg.shape.rope and cfg.shape.rope.rope_type == "dynamic"
    if cfg.use_qk_layernorm or dynamic or cfg.moe_num_experts > 1:
        assert problem, name  # query/key norms, dynamic NTK and experts take the other steps
        gen = Generator(model, VOCAB, eod=PADDED - 1, fused_step=True)
        assert not gen.fused_for(1)
        return
    assert problem is None, problem
    for rows in (4,):  # left-padded rows of different lengths
        a, b, eager, fused = both(model, PROMPTS[:rows])
        assert [c.tokens for c in a] == [c.tokens for c in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(x.logits, y.logits, rtol=1e-4, atol=1e-4)
    # The fused step wrote the cache the eager step wrote (every slot of every layer).
    for ea, fu in zip(eager._session.cache.layers, fused._session.cache.layers):
        torch.testing.assert_close(ea.k, fu.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ea.v, fu.v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["gpt_neox", "llama_gqa"])
def test_fused_step_at_two_rows_and_other_batches_fall_back(case):
    model, _ = tiny_pair(case)
    a, b, _, fused = both(model, PROMPTS[:2])
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert not fused.fused_for(3) and not fused.fused_for(8)  # the other steps take these
    three = fused.generate(PROMPTS[:3], 4)
    want = Generator(model, VOCAB, eod=PADDED - 1).generate(PROMPTS[:3], 4)
    assert [c.tokens for c in three] == [c.tokens for c in want]


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_norm_linear_rounds_where_eager_rounds_in_bf16():
    """LayerNorm in fp32 rounded once, the product summed in fp32 with the bias before one
    rounding, the activation on the rounded value: the kernel's arithmetic, to the last bit
    but for the order of an fp32 sum."""
    x, w, b = bf16(2, 96), bf16(80, 96, seed=1), bf16(80, seed=2)
    g, nb = bf16(96, seed=3), bf16(96, seed=4)
    up, gate, gb, ub = bf16(40, 96, seed=5), bf16(40, 96, seed=6), bf16(40, seed=7), bf16(40)
    out_a, out_b = norm_linear(
        x, "layernorm", 1e-5, (g, nb), LinearPart(w, b), LinearPart(up, ub, "silu", gate, gb)
    )
    xn = F.layer_norm(x.float(), (96,), g.float(), nb.float(), 1e-5).bfloat16().float()
    want_a = (xn @ w.float().T + b.float()).bfloat16()
    gated = F.silu((xn @ gate.float().T + gb.float()).bfloat16().float()).bfloat16()
    want_b = (gated.float() * (xn @ up.float().T + ub.float()).bfloat16().float()).bfloat16()
    ulp = 2.0**-7
    assert (out_a.float() - want_a.float()).abs().le(ulp * want_a.float().abs() + 1e-6).all()
    assert (out_b.float() - want_b.float()).abs().le(ulp * want_b.float().abs() + 1e-6).all()
    assert (out_a == want_a).float().mean() > 0.95  # almost all bit-identical
    assert (out_b == want_b).float().mean() > 0.95


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu"])
def test_rmsnorm_and_activations(act):
    x, w = torch.randn(1, 64), torch.randn(48, 64)
    g = torch.rand(64) + 0.5
    out, _ = norm_linear(x, "rmsnorm", 1e-6, (g, None), LinearPart(w, None, act))
    xn = g * F.rms_norm(x, (64,), eps=1e-6)
    h = xn @ w.T
    want = {"gelu": F.gelu(h), "gelu_tanh": F.gelu(h, approximate="tanh"), "relu": F.relu(h)}
    torch.testing.assert_close(out, want[act], rtol=1e-5, atol=1e-5)


def test_linear_residual_adds_each_term_rounded():
    x, y, h = bf16(1, 64), bf16(1, 32, seed=1), bf16(1, 128, seed=2)
    w1, b1, w2, b2 = bf16(64, 32, seed=3), bf16(64, seed=4), bf16(64, 128, seed=5), bf16(64, seed=6)
    out = linear_residual(x, y, w1, b1, h, w2, b2)
    a = (y.float() @ w1.float().T + b1.float()).bfloat16()
    m = (h.float() @ w2.float().T + b2.float()).bfloat16()
    want = (x + a) + m  # bf16 adds: each rounded
    assert (out.float() - want.float()).abs().le(2.0**-7 * want.float().abs() + 1e-6).all()


@pytest.mark.parametrize("S, slot", [(24, 11), (300, 203)])
def test_cached_attention_sees_valid_slots_up_to_its_own_within_the_window(S, slot):
    """Against softmax(q k^T) v over the slots a query may see: valid, not after its own slot,
    within the window; its own key and value come from this step (written to the cache). At
    300 slots the cache is split over 8 programs a head, the last to finish combining them
    (and leaving its counters at zero for the next call)."""
    torch.manual_seed(0)
    rows, nh, nkv, hs, rot = 2, 4, 2, 16, 8
    qkv = torch.randn(rows, (nh + 2 * nkv) * hs)
    k_cache, v_cache = torch.randn(rows, nkv, S, hs), torch.randn(rows, nkv, S, hs)
    pos = torch.tensor([[slot - 2], [slot - 7]])
    valid = torch.zeros(rows, S, dtype=torch.bool)
    valid[0, : slot + 1] = True
    valid[1, 7 : slot + 1] = True  # row 1 left-padded
    angles = torch.arange(S)[:, None] * torch.rand(rot // 2)[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    for window in (None, 3, 100):
        kc, vc = k_cache.clone(), v_cache.clone()
        slot_t = torch.tensor([slot])
        out = cached_attention(qkv, cos, sin, pos, slot_t, valid, kc, vc, nh, hs**-0.5, window)
        groups = qkv.view(rows, nkv, nh // nkv + 2, hs)
        q = groups[:, :, :-2].reshape(rows, nh, hs)
        k, v = groups[:, :, -2], groups[:, :, -1]

        def rotate(t, p):
            c, s = cos[p], sin[p]
            r = t[..., :rot]
            half = torch.cat((-r[..., rot // 2 :], r[..., : rot // 2]), -1)
            return torch.cat((r * c + half * s, t[..., rot:]), -1)

        for r in range(rows):
            qr, kr = rotate(q[r], pos[r, 0]), rotate(k[r], pos[r, 0])
            torch.testing.assert_close(kc[r, :, slot], kr)
            torch.testing.assert_close(vc[r, :, slot], v[r])
            seen = valid[r].clone()
            seen[slot + 1 :] = False
            if window is not None:
                seen[: max(slot - window, 0)] = False
            keys = kc[r].repeat_interleave(nh // nkv, 0)  # (nh, S, hs)
            vals = vc[r].repeat_interleave(nh // nkv, 0)
            scores = (qr[:, None, :] * keys).sum(-1) * hs**-0.5
            probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            want = (probs[:, :, None] * vals).sum(1).reshape(-1)
            torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(kc[:, :, :slot], k_cache[:, :, :slot])  # other slots untouched
        assert torch.equal(kc[:, :, slot + 1 :], k_cache[:, :, slot + 1 :])


def test_rows_longer_than_a_block_take_the_looped_path():
    """4 rows of 3000 features exceed what a program holds at once (ROW_ELEMENTS): the norm's
    statistics take their own passes and the products loop over blocks of K."""
    from neox.kernels.decode import ROW_ELEMENTS

    rows, K = 4, 3000
    assert rows * K > ROW_ELEMENTS
    x, w = torch.randn(rows, K), torch.randn(24, K)
    g, nb = torch.rand(K) + 0.5, torch.randn(K)
    out, _ = norm_linear(x, "layernorm", 1e-5, (g, nb), LinearPart(w, None, "relu"))
    want = F.relu(F.layer_norm(x, (K,), g, nb, 1e-5) @ w.T)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    y, w2 = torch.randn(rows, K), torch.randn(24, K)
    res = torch.randn(rows, 24)
    torch.testing.assert_close(
        linear_residual(res, y, w2, None), res + y @ w2.T, rtol=1e-4, atol=1e-4
    )


def test_attention_scratch_is_reused_across_calls():
    from neox.kernels.decode import AttentionScratch

    rows, nh, hs, S = 1, 2, 16, 200
    scratch = AttentionScratch(rows, nh, hs, S, "cpu")
    assert scratch.splits > 1
    qkv = torch.randn(rows, 3 * nh * hs)
    kc, vc = torch.randn(rows, nh, S, hs), torch.randn(rows, nh, S, hs)
    valid = torch.ones(rows, S, dtype=torch.bool)
    pos, slot = torch.tensor([[150]]), torch.tensor([150])
    outs = [
        cached_attention(qkv, None, None, pos, slot, valid, kc, vc, nh, 0.25, None, scratch)
        for _ in range(2)
    ]
    assert torch.equal(scratch.count, torch.zeros_like(scratch.count))
    torch.testing.assert_close(outs[0], outs[1])


def test_greedy_choice_is_the_generators_choose():
    """Against Generator._choose: the first of equal maxima within the real vocabulary (ties
    across blocks included), eod for an ended row, the raw logit, finished updated, counters
    left at zero for the next call."""
    from neox.inference.generator import DecodeState
    from neox.kernels.decode import GreedyScratch, greedy_choice

    vocab, padded, eod = 5000, 5120, 7
    logits = torch.randn(4, padded).bfloat16()
    logits[0, 4100] = logits[0, 300] = 50.0  # a tie across blocks: the first wins
    logits[1, vocab + 3] = 99.0  # a padded id never wins
    logits[2, eod] = 80.0  # row 2 chooses the end of document
    scratch = GreedyScratch(4, vocab, "cpu")
    for step in range(2):
        want, got = DecodeState(4, 16, "cpu"), DecodeState(4, 16, "cpu")
        for s in (want, got):
            s.finished[3] = True  # row 3 ended earlier
            s.slot.fill_(5 + step)
        gen = Generator.__new__(Generator)
        gen.gather_logits, gen.vocab_size, gen.eod = (lambda x: x), vocab, eod
        gen._choose(want, logits, SamplingParams(), None)
        greedy_choice(
            logits, vocab, eod, got.finished, got.tokens, got.logits, got.tok, got.slot, scratch
        )
        assert got.tok.tolist() == want.tok.tolist() == [300, got.tok[1].item(), eod, eod]
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.finished, want.finished)
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
        assert not scratch.count.any()


def test_fused_greedy_rows_end_at_the_end_of_document_as_eager_rows_do():
    """The fused step with its greedy kernel (FusedStep.greedy_kernel) against the eager
    step, rows ending at different steps."""
    model, _ = tiny_pair("gpt_neox")
    free = Generator(model, VOCAB, eod=PADDED - 1).generate(PROMPTS, NEW)
    eod = free[0].tokens[2]  # row 0 ends at its third token; others when they meet it
    want = Generator(model, VOCAB, eod=eod).generate(PROMPTS, NEW, return_logits=True)
    fused = Generator(model, VOCAB, eod=eod, fused_step=True)
    fused._fused.greedy_kernel = True
    got = fused.generate(PROMPTS, NEW, return_logits=True)
    assert [(c.tokens, c.finished) for c in got] == [(c.tokens, c.finished) for c in want]
    assert got[0].finished and len(got[0].tokens) == 2
    assert not got[1].finished and len(got[1].tokens) == NEW  # ran on past row 0's end
    for a, b in zip(got, want):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
