"""Generation on one GPU: greedy tokens equal transformers' (fp32), and Pythia-410M's shape in
bf16 decodes with the KV cache as it does recomputing."""

from pathlib import Path

import pytest
import torch

from neox.config import load_config, pad_vocab_size
from neox.inference.engine import Generator
from neox.model import build_model
from tests.inference.test_engine import PADDED, PROMPTS, VOCAB, hf_greedy, tiny_pair

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


@pytest.mark.parametrize("case", ["gpt_neox", "llama_gqa"])
def test_greedy_matches_transformers_on_gpu(case):
    model, hf = tiny_pair(case)
    model, hf = model.cuda(), hf.cuda()
    expected = hf_greedy(hf, PROMPTS, 12, device="cuda")
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
