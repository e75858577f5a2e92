"""Generation on one GPU: greedy tokens equal transformers' (fp32); Pythia-410M's shape in bf16
decodes with the KV cache as it does recomputing; the captured decode step (CUDA graph, greedy
choice inside; compiled or not) equals eager decoding on a trained model, and decoding has no
host sync per token.
All of it in well under two minutes on one H100: `pytest tests/gpu/test_generate_gpu.py`."""

import warnings
from pathlib import Path

import pytest
import torch

from neox.config import load_config, pad_vocab_size
from neox.config.model import ModelConfig
from neox.inference.generator import Generator
from neox.inference.sampling import SamplingParams
from neox.model import build_model, lm_loss
from tests.hf_family_helpers import hf_greedy
from tests.inference.test_generator import EOD, PADDED, PROMPTS, VOCAB, tiny_pair

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

TEXT = (
    "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
    "all that glitters is not gold. the early bird catches the worm. "
)
SPACE = ord(" ")


@pytest.fixture(scope="module")
def trained():
    """A tiny char-level model trained on TEXT for a few hundred steps (seconds on a GPU): its
    greedy continuations are words, not the loop of one token a random model falls into."""
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=64,
        # Decoding goes past the training length (96 new tokens): the rotary table must cover it,
        # as generate.py's maximum_tokens cut ensures.
        max_position_embeddings=256,
        pos_emb="rotary",
    )
    torch.manual_seed(0)
    model = build_model(cfg, 512, seed=1).cuda()
    data = torch.tensor(list(TEXT.encode()) * 4, device="cuda")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        starts = torch.randint(0, len(data) - 49, (16,), device="cuda")
        batch = torch.stack([data[s : s + 49] for s in starts.tolist()])
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 1.0
    return model.eval()


def char_prompts():
    return [list(p.encode()) for p in ("the quick", "a st", "all that glit", "the early bird c")]


@pytest.mark.parametrize("case", ["gpt_neox", "llama_gqa"])
def test_greedy_matches_transformers_on_gpu(case):
    model, hf = tiny_pair(case)
    model, hf = model.cuda(), hf.cuda()
    expected = hf_greedy(hf, PROMPTS, 12, EOD, device="cuda")
    got = Generator(model, VOCAB, eod=PADDED - 1).generate(PROMPTS, 12)
    assert [c.tokens for c in got] == expected


def test_pythia_410m_bf16_cache_agrees_with_recompute():
    cfg = load_config([str(ROOT / "configs" / "pythia" / "410M.yml")]).config.model
    vocab = 50277
    model = build_model(cfg, pad_vocab_size(vocab, cfg.make_vocab_size_divisible_by, 1), 1234)
    model = model.to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (100, 37, 5, 64)]
    cached = Generator(model, vocab, eod=50303).generate(prompts, 32, return_logits=True)
    full = Generator(model, vocab, eod=50303, use_cache=False).generate(
        prompts, 32, return_logits=True
    )
    for a, b in zip(cached, full):
        assert len(a.tokens) == 32 and max(a.tokens) < vocab
        assert a.tokens[0] == b.tokens[0]
        # bf16 rounding may flip a near-tie later on; the first steps agree.
        assert a.logits[0] == pytest.approx(b.logits[0], rel=2e-2, abs=5e-2)


@pytest.mark.parametrize("case", ["gpt_neox", "llama_gqa"])
def test_cuda_graph_decode_equals_eager_decode(case):
    model, _ = tiny_pair(case)
    model = model.cuda()
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6]]
    graphed = Generator(model, VOCAB, eod=PADDED - 1).generate(prompts, 16, return_logits=True)
    eager = Generator(model, VOCAB, eod=PADDED - 1, cuda_graphs=False).generate(
        prompts, 16, return_logits=True
    )
    assert [c.tokens for c in graphed] == [c.tokens for c in eager]
    for a, b in zip(graphed, eager):
        assert a.logits == pytest.approx(b.logits, rel=1e-5, abs=1e-5)


def test_captured_step_equals_eager_on_a_trained_model(trained):
    """Greedy (choice captured) and sampled (choice eager) decoding, rows ending at different
    steps (eod = space), a captured step reused by the next batch of its shape and a new one
    for another shape: all equal eager decoding with the per-token stop check."""
    prompts = char_prompts()
    eager = Generator(trained, 256, eod=SPACE, cuda_graphs=False, stop_check_every=1)
    graphed = Generator(trained, 256, eod=SPACE)
    assert graphed.cuda_graphs
    sampled = SamplingParams(temperature=0.8, top_k=5)

    def run(gen, batch, params=SamplingParams()):
        rng = torch.Generator(device="cuda").manual_seed(3)
        done = gen.generate(batch, 40, params, rng, return_logits=True)
        return [(c.tokens, c.finished) for c in done], [c.logits for c in done]

    greedy = SamplingParams()
    cases = [(prompts, greedy), (prompts[::-1], greedy), (prompts[:1], greedy)]
    cases += [(prompts, sampled), (prompts[::-1], sampled)]
    sessions = []
    for batch, params in cases:
        want, want_logits = run(eager, batch, params)
        got, got_logits = run(graphed, batch, params)
        sessions.append(graphed._session)
        assert got == want
        for a, b in zip(got_logits, want_logits):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    # Reversed prompts have the same shape: the captured step of the call before served them.
    assert sessions[1] is sessions[0] and sessions[4] is sessions[3]
    assert sessions[2] is not sessions[1]
    rows, _ = run(graphed, prompts)
    words = [bytes(tokens).decode() for tokens, _ in rows]
    assert len({len(w) for w in words}) > 1 and all(finished for _, finished in rows), words


def test_compiled_captured_step_equals_eager_on_a_trained_model(trained):
    """compile_step (generate.py's default on GPUs): the whole decode step compiled, then
    captured; the same tokens as eager decoding, for two batch shapes."""
    prompts = char_prompts()
    eager = Generator(trained, 256, eod=SPACE, cuda_graphs=False)
    compiled = Generator(trained, 256, eod=SPACE, compile_step=True)
    for batch in (prompts, prompts[1:3]):
        want = eager.generate(batch, 40, return_logits=True)
        got = compiled.generate(batch, 40, return_logits=True)
        assert compiled._compiled is not None  # it compiled, rather than falling back
        assert [c.tokens for c in got] == [c.tokens for c in want]
        for a, b in zip(got, want):
            assert a.logits == pytest.approx(b.logits, rel=1e-4, abs=1e-4)


def test_compiled_captured_step_in_bf16_equals_the_eager_path_on_a_trained_model(trained):
    """generate.py's GPU default (bf16, compiled and captured step) against the reference path
    (eager, uncaptured, no compilation) on a trained model: exactly the same greedy tokens,
    rows ending at different steps included; logits within bf16 rounding."""
    model = build_model(trained.cfg, 512, seed=1)
    model.load_state_dict(trained.state_dict())
    model = model.to("cuda", torch.bfloat16).eval()
    prompts = char_prompts()
    for eod in (SPACE, 511):  # rows ending at their first space; every row running 64 tokens
        reference = Generator(model, 256, eod=eod, cuda_graphs=False)
        fast = Generator(model, 256, eod=eod, compile_step=True)
        for batch in (prompts, prompts[:1]):
            want = reference.generate(batch, 64, return_logits=True)
            got = fast.generate(batch, 64, return_logits=True)
            assert fast._compiled is not None and fast._session.step is not None
            assert [(c.tokens, c.finished) for c in got] == [(c.tokens, c.finished) for c in want]
            for a, b in zip(got, want):
                assert a.logits == pytest.approx(b.logits, rel=3e-2, abs=0.1)
    words = [bytes(c.tokens).decode() for c in want]
    assert len(set(bytes(want[0].tokens))) > 5, words  # words, not one repeated character


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphed", "eager"])
def test_decoding_has_no_host_sync_per_token(trained, cuda_graphs):
    """Host syncs of a generate call grow with the stop checks only (one per 16 tokens), not
    with the tokens: 96 tokens take 4 stop checks more than 32 (a sync or two each); a sync per
    token would add 64."""
    gen = Generator(trained, 256, eod=0, cuda_graphs=cuda_graphs)
    prompts = char_prompts()

    def syncs(n):
        gen.generate(prompts, n)  # warm-up: capture and allocations happen outside the count
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gen.generate(prompts, n)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    assert 4 <= syncs(96) - syncs(32) < 16


def test_pythia_410m_bf16_graphed_greedy_equals_eager():
    """The captured step at Pythia-410M's shape in bf16: the same kernels as eager decoding, so
    the same tokens, near-ties included."""
    cfg = load_config([str(ROOT / "configs" / "pythia" / "410M.yml")]).config.model
    vocab = 50277
    model = build_model(cfg, pad_vocab_size(vocab, cfg.make_vocab_size_divisible_by, 1), 1234)
    model = model.to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (128, 128, 90, 7)]
    graphed = Generator(model, vocab, eod=50303).generate(prompts, 64, return_logits=True)
    eager = Generator(model, vocab, eod=50303, cuda_graphs=False).generate(
        prompts, 64, return_logits=True
    )
    assert [c.tokens for c in graphed] == [c.tokens for c in eager]
    assert [c.logits for c in graphed] == [c.logits for c in eager]


@pytest.mark.parametrize("greedy_kernel", [False, True], ids=["torch_choice", "kernel_choice"])
def test_fused_captured_step_in_bf16_equals_the_eager_path_on_a_trained_model(
    trained, greedy_kernel
):
    """The fused step (neox.inference.fused_step: three Triton kernels a layer, captured),
    generate.py's GPU default at batch 1, 2 and 4, against the reference path (eager,
    uncaptured): exactly the same greedy tokens, rows ending at different steps included;
    with the greedy choice as torch ops (the default) or as one kernel."""
    model = build_model(trained.cfg, 512, seed=1)
    model.load_state_dict(trained.state_dict())
    model = model.to("cuda", torch.bfloat16).eval()
    prompts = char_prompts()
    for eod in (SPACE, 511):
        reference = Generator(model, 256, eod=eod, cuda_graphs=False)
        fast = Generator(model, 256, eod=eod, fused_step=True)
        fast._fused.greedy_kernel = greedy_kernel
        for batch in (prompts, prompts[:1], prompts[1:3]):
            want = reference.generate(batch, 64, return_logits=True)
            got = fast.generate(batch, 64, return_logits=True)
            assert fast.fused_for(len(batch)) and fast._session.step is not None
            assert [(c.tokens, c.finished) for c in got] == [(c.tokens, c.finished) for c in want]
            for a, b in zip(got, want):
                assert a.logits == pytest.approx(b.logits, rel=3e-2, abs=0.1)


@pytest.mark.parametrize("case", ["gpt_neox", "llama_gqa"])
def test_fused_step_in_fp32_equals_eager_decode(case):
    model, _ = tiny_pair(case)
    model = model.cuda()
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6]]
    fused = Generator(model, VOCAB, eod=PADDED - 1, fused_step=True)
    got = fused.generate(prompts, 16, return_logits=True)
    eager = Generator(model, VOCAB, eod=PADDED - 1, cuda_graphs=False).generate(
        prompts, 16, return_logits=True
    )
    assert fused.fused_for(len(prompts))
    assert [c.tokens for c in got] == [c.tokens for c in eager]
    for a, b in zip(got, eager):
        assert a.logits == pytest.approx(b.logits, rel=1e-4, abs=1e-4)
