"""Greedy generation equals transformers' greedy generate; the KV cache equals recompute."""

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from neox.config.model import ModelConfig
from neox.hf.mapping import hf_config_for, to_hf_state_dict
from neox.inference.generator import Generator, left_pad
from neox.inference.sampling import SamplingParams
from neox.model import build_model
from tests.hf_family_helpers import hf_greedy
from tests.inference.conftest import KNOWN

VOCAB, PADDED = 97, 128
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64, pos_emb="rotary")
LLAMA = dict(
    norm="rmsnorm", activation="swiglu", use_bias_in_attn_linear=False, use_bias_in_mlp=False
)
CASES = {
    "gpt_neox": ("gpt_neox", dict(gpt_j_residual=True, rotary_pct=0.25, no_weight_tying=True)),
    "llama_gqa": ("llama", dict(**LLAMA, num_kv_heads=2)),
}
PROMPTS = [[5, 17, 3, 44, 9, 12, 30], [8], [61, 2, 2, 70]]
EOD = 0


def tiny_pair(case: str, seed: int = 3):
    """Our model and the transformers model holding the same weights (HF from ours)."""
    arch, overrides = CASES[case]
    cfg = ModelConfig(**TINY, **overrides)
    model = build_model(cfg, PADDED, seed=seed).eval()
    cls, conf = {
        "gpt_neox": (GPTNeoXForCausalLM, GPTNeoXConfig),
        "llama": (LlamaForCausalLM, LlamaConfig),
    }[arch]
    hf = cls(conf(**hf_config_for(cfg, VOCAB, arch))).eval()
    hf_sd = to_hf_state_dict(model.state_dict(), cfg, VOCAB, arch)
    # transformers >= 5 calls GPTNeoX's output layer lm_head in memory (embed_out on disk).
    hf_sd = {("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in hf_sd.items()}
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return model, hf


@pytest.mark.parametrize("case", CASES)
def test_greedy_matches_transformers_generate(case):
    model, hf = tiny_pair(case)
    new = 12
    expected = hf_greedy(hf, PROMPTS, new, EOD)
    # eod = an id no model picks here (the padded range), so every row runs the whole budget.
    gen = Generator(model, VOCAB, eod=PADDED - 1)
    got = [c.tokens for c in gen.generate(PROMPTS, new)]
    assert got == expected
    recomputed = Generator(model, VOCAB, eod=PADDED - 1, use_cache=False).generate(PROMPTS, new)
    assert [c.tokens for c in recomputed] == expected


def test_end_of_document_ends_a_row_and_matches_transformers_eos():
    model, hf = tiny_pair("gpt_neox")
    free = Generator(model, VOCAB, eod=PADDED - 1).generate(PROMPTS, 12)
    # Make the third token of row 0 the end-of-document id: row 0 must stop right before it.
    eod = free[0].tokens[2]
    done = Generator(model, VOCAB, eod=eod).generate(PROMPTS, 12)
    first = free[0].tokens.index(eod)
    assert done[0].tokens == free[0].tokens[:first] and done[0].finished
    for row, c in zip(free, done):
        end = row.tokens.index(eod) if eod in row.tokens else len(row.tokens)
        assert c.tokens == row.tokens[:end] and c.finished == (end < 12)
    ids, mask = left_pad(PROMPTS, eod, "cpu")
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask.long(),
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=eod,
        eos_token_id=eod,
    )[:, ids.shape[1] :].tolist()
    assert [c.tokens for c in done] == [r[: r.index(eod)] if eod in r else r for r in out]


@pytest.mark.parametrize(
    "overrides",
    [dict(pos_emb="learned"), dict(pos_emb="none", num_kv_heads=2)],
    ids=["learned", "nope_gqa"],
)
def test_kv_cache_equals_recompute_for_other_position_schemes(overrides):
    cfg = ModelConfig(**{**TINY, **overrides})
    model = build_model(cfg, PADDED, seed=5).eval()
    cached = Generator(model, VOCAB, eod=PADDED - 1).generate(PROMPTS, 10, return_logits=True)
    full = Generator(model, VOCAB, eod=PADDED - 1, use_cache=False).generate(
        PROMPTS, 10, return_logits=True
    )
    assert [c.tokens for c in cached] == [c.tokens for c in full]
    for a, b in zip(cached, full):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-5)


def test_alibi_needs_recompute_and_recompute_generates():
    cfg = ModelConfig(**{**TINY, "pos_emb": "alibi"})
    model = build_model(cfg, PADDED, seed=5).eval()
    with pytest.raises(ValueError, match="recompute: true"):
        Generator(model, VOCAB, eod=0)
    out = Generator(model, VOCAB, eod=PADDED - 1, use_cache=False).generate(PROMPTS, 4)
    assert all(len(c.tokens) == 4 and max(c.tokens) < VOCAB for c in out)


def test_sampling_is_seed_reproducible():
    model, _ = tiny_pair("llama_gqa")
    gen = Generator(model, VOCAB, eod=PADDED - 1)
    params = SamplingParams(temperature=1.5, top_k=40, top_p=0.95)

    def draw(seed):
        rng = torch.Generator().manual_seed(seed)
        return [c.tokens for c in gen.generate(PROMPTS, 16, params, rng)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    greedy = [c.tokens for c in gen.generate(PROMPTS, 16)]
    assert draw(7) != greedy  # it does sample
    top1 = SamplingParams(temperature=1.0, top_k=1)
    assert [c.tokens for c in gen.generate(PROMPTS, 16, top1, torch.Generator())] == greedy


def test_long_prompts_keep_their_end_and_the_budget_fits_max_positions():
    from neox.config import load_dict
    from neox.inference.modes import TextGenerator
    from neox.tokenizer.char import CharLevelTokenizer

    # Learned positions: a continuation past max_positions would index outside the table.
    cfg = load_dict({**TINY, "pos_emb": "learned", "seq_length": 16, "maximum_tokens": 8})
    model = build_model(cfg.model, 512, seed=1).eval()
    tok = CharLevelTokenizer()
    text_gen = TextGenerator(cfg, Generator(model, 256, tok.eod), tok, batch_size=2)
    # 12 characters leave 4 of the 16 positions; 40 keep their last 15 and leave 1.
    short, long = text_gen.rows(["x" * 12, "y" * 39 + "z"])
    assert short["length"] <= 4 and long["length"] <= 1
    assert text_gen._encode("y" * 39 + "z") == tok.encode("y" * 14 + "z")


def outputs(done):
    return [(c.tokens, c.finished, c.logits) for c in done]


def test_stop_check_interval_leaves_tokens_and_logits_unchanged():
    """Rows ending at different steps: checking "all ended" every 16 or 5 tokens gives what the
    per-token check (1) gives, with the cache and recomputing."""
    model, _ = tiny_pair("gpt_neox")
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6]]
    free = Generator(model, VOCAB, eod=PADDED - 1).generate(prompts, 40)
    # The end-of-document id: a token the rows reach at different steps, some never.
    firsts = {}
    for c in free:
        for i, t in enumerate(c.tokens):
            firsts.setdefault(t, []).append(i) if i == c.tokens.index(t) else None
    eod = max(firsts, key=lambda t: (len(set(firsts[t])), -min(firsts[t])))
    for use_cache in (True, False):
        runs = {
            k: Generator(model, VOCAB, eod, use_cache, stop_check_every=k).generate(
                prompts, 40, return_logits=True
            )
            for k in (1, 5, 16)
        }
        ends = {len(c.tokens) for c in runs[1] if c.finished}
        assert len(ends) >= 2  # rows do end at different steps
        assert outputs(runs[5]) == outputs(runs[1]) == outputs(runs[16])


def test_stop_check_interval_leaves_sampling_and_the_next_batch_unchanged():
    """Sampled rows end at random steps; the generator is rewound to the draw where every row
    had ended, so a second batch from the same generator samples the same tokens too."""
    model, _ = tiny_pair("llama_gqa")
    params = SamplingParams(temperature=2.0)

    def two_batches(k):
        # Six ids, one of them the end: rows end after a few tokens, each at its own step.
        gen = Generator(model, 6, eod=1, stop_check_every=k)
        rng = torch.Generator().manual_seed(11)
        return [outputs(gen.generate(PROMPTS, 40, params, rng, return_logits=True)) for _ in "ab"]

    reference = two_batches(1)
    for batch in reference:
        assert all(finished for _, finished, _ in batch)
        assert len({len(tokens) for tokens, _, _ in batch}) >= 2
    assert two_batches(16) == reference
    assert two_batches(7) == reference


def test_generate_reports_its_timing():
    model, _ = tiny_pair("gpt_neox")
    gen = Generator(model, VOCAB, eod=PADDED - 1, stop_check_every=4)
    gen.generate(PROMPTS, 10)
    stats = gen.last_stats
    assert stats.steps == 10 and 0 < stats.prefill_seconds < stats.seconds


def test_text_generator_rows_report_the_batch_speed():
    from neox.config import load_dict
    from neox.inference.modes import TextGenerator
    from neox.tokenizer.char import CharLevelTokenizer

    cfg = load_dict({**TINY, "maximum_tokens": 6})
    model = build_model(cfg.model, 512, seed=1).eval()
    tok = CharLevelTokenizer()
    # eod = a padded id: every row runs its whole budget.
    text_gen = TextGenerator(cfg, Generator(model, 256, 511), tok, batch_size=2)
    rows = list(text_gen.rows(["abc", "de", "fgh"]))
    assert [r["length"] for r in rows] == [6, 6, 6]
    for batch, size in ((rows[:2], 2), (rows[2:], 1)):
        assert len({(r["duration_seconds"], r["tokens_per_second"]) for r in batch}) == 1
        r = batch[0]
        assert 0 < r["prefill_seconds"] < r["duration_seconds"]
        assert r["tokens_per_second"] * r["duration_seconds"] == pytest.approx(6 * size)


@pytest.mark.slow
def test_compiled_decode_step_equals_eager(memorised, chars):
    """compile_step (the whole decode step through inductor, the KV cache written in place)
    decodes exactly what the eager step decodes on a trained model, for a second batch shape
    too; the model itself is left as it was."""
    prompts = [chars.encode(t[:n]) for t, n in zip(KNOWN * 2, (4, 9, 13, 2))]
    eager = Generator(memorised, 256, eod=511)
    compiled = Generator(memorised, 256, eod=511, compile_step=True)
    for batch in (prompts, prompts[:2]):
        want = eager.generate(batch, 20, return_logits=True)
        got = compiled.generate(batch, 20, return_logits=True)
        assert compiled._compiled is not None  # it compiled, rather than falling back
        assert [c.tokens for c in got] == [c.tokens for c in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-5)
    # Trained: the continuations are the memorised text, not one repeated token.
    assert chars.decode(want[0].tokens) == KNOWN[0][4:24]
    assert all("forward" not in block.__dict__ for block in memorised.layers)
