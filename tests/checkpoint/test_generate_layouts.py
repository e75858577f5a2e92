"""Checkpoints trained at tp=2 and pp=2 generate the dense run's greedy text (the layouts
reproduce the losses, so the weights, and with them the argmax tokens, agree).

The checkpoints are the session's shared layout runs (tests/layout_helpers.py).
"""

import pytest
import torch

from neox.checkpoint.consolidate import load_model
from neox.inference.generator import Generator
from neox.tokenizer import build_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = ["Configuration reference", "the model", "deepy.py train.py configs"]


def greedy(save_dir):
    model, cfg = load_model(save_dir)
    t = cfg.tokenizer
    tok = build_tokenizer(t.tokenizer_type, t.vocab_file, t.merge_file)
    gen = Generator(model, tok.vocab_size, tok.eod)
    done = gen.generate([tok.encode(p) for p in PROMPTS], 12, return_logits=True)
    return [c.tokens for c in done], [c.logits for c in done]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_parallel_layouts_generate_the_dense_greedy_text(trained, layout):
    tokens, logits = greedy(trained["dense"])
    other_tokens, other_logits = greedy(trained[layout])
    assert other_tokens == tokens
    for a, b in zip(logits, other_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
