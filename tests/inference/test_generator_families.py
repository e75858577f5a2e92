"""Greedy decoding through the KV-cache engine equals transformers' generate for every family,
32 new tokens past the sliding window and past the original RoPE length (dynamic NTK included:
its base grows token by token, and cached keys keep the rotation they were stored with)."""

import pytest
import torch

from neox.inference.generator import Generator
from tests.hf_family_helpers import FAMILIES, PADDED, VOCAB, hf_greedy, neox_pair

# Left-padded batch; the longest prompt alone is past the windows (5-7) and the original RoPE
# lengths (16), and 32 new tokens take every row past the 64 max_position_embeddings of most.
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(20)], [8, 1, 50], [61, 2, 2, 70, 33, 9, 1, 0, 4]]
NEW = 32
PAD = 0


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_greedy_decoding_matches_transformers_generate(name):
    _, cfg, model, hf = neox_pair(name)
    expected = hf_greedy(hf, PROMPTS, NEW, PAD)
    # eod = a padded id, never chosen, so every row runs the whole budget.
    gen = Generator(model, VOCAB, eod=PADDED - 1)
    got = gen.generate(PROMPTS, NEW, return_logits=True)
    assert [c.tokens for c in got] == expected
    if cfg.shape.rope is None or cfg.shape.rope.rope_type != "dynamic":
        # Recomputing the whole sequence each token gives the same tokens and logits (dynamic
        # NTK does not: without a cache every key is re-rotated with the newest base, as in
        # transformers without a cache).
        full = Generator(model, VOCAB, eod=PADDED - 1, use_cache=False)
        again = full.generate(PROMPTS, NEW, return_logits=True)
        assert [c.tokens for c in again] == expected
        for a, b in zip(got, again):
            torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)


# One family per feature a decode step traces differently: dynamic NTK (base chosen on the
# device), MQA, a sliding window, QK-norm with YaRN.
TRACED = ["gpt_neox_partial_dynamic_untied", "llama_dynamic_mqa", "mistral_window"]
TRACED += ["qwen3_qknorm_head_dim_yarn"]


@pytest.mark.parametrize("name", TRACED)
def test_whole_decode_step_traces_as_one_graph(name):
    """compile_step's function (embedding to greedy choice) traces without a graph break
    (fullgraph; aot_eager runs the traced graph without generating code, so this stays fast on
    CPU) and decodes what the eager step decodes."""
    torch._dynamo.reset()  # Generator._decode's cache holds earlier tests' entries otherwise
    _, _, model, _ = neox_pair(name)
    eager = Generator(model, VOCAB, eod=PADDED - 1).generate(PROMPTS, NEW, return_logits=True)
    gen = Generator(model, VOCAB, eod=PADDED - 1, compile_step=True)
    gen._compiled = torch.compile(gen._decode, dynamic=False, fullgraph=True, backend="aot_eager")
    got = gen.generate(PROMPTS, NEW, return_logits=True)
    assert [c.tokens for c in got] == [c.tokens for c in eager]
    for a, b in zip(got, eager):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
