"""Windows and scores: full-context parity, sliding window vs a per-token loop, HF parity."""

import math

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from neox.config.model import ModelConfig
from neox.hf.mapping import hf_config_for, to_hf_state_dict
from neox.inference.perplexity import TextSums, bits_per_byte, score_texts, text_metrics
from neox.inference.scoring import (
    continuation_window,
    rolling_windows,
    score_windows,
)
from neox.model import build_model, lm_loss

MAX_LEN = 16
CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=MAX_LEN,
    max_position_embeddings=MAX_LEN,
    pos_emb="rotary",
    rotary_pct=0.25,
    gpt_j_residual=True,
    no_weight_tying=True,  # transformers' GPTNeoX holds its own output matrix
)
VOCAB = 512  # the char-level tokenizer's, already a multiple of 128: no padded rows


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, VOCAB, seed=5).eval()


def full_context_nll(model, seq: list[int]) -> float:
    """-log p(seq[1:] | seq[0]) in one forward pass."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        return lm_loss(model(ids[:, :-1]), ids[:, 1:]).item() * (len(seq) - 1)


def per_token_nll(model, seq: list[int], context: int) -> float:
    """Brute force: each token scored alone, after at most `context` tokens before it."""
    total = 0.0
    with torch.no_grad():
        for t in range(1, len(seq)):
            ids = torch.tensor([seq[max(0, t - context) : t]])
            total -= torch.log_softmax(model(ids)[0, -1].double(), -1)[seq[t]].item()
    return total


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 18, 40, 61])
@pytest.mark.parametrize("stride", [1, 3, 16])
def test_every_token_is_scored_once_with_enough_context(n, stride):
    seq = list(range(100, 100 + n))
    windows = rolling_windows(seq, MAX_LEN, stride)
    scored = [t for w in windows for t in w.tokens[-w.num_targets :]]
    assert scored == seq[1:]
    for i, w in enumerate(windows):
        assert len(w.tokens) - 1 <= MAX_LEN  # the model never reads more than max_len tokens
        if i > 0:  # later windows keep max_len - stride tokens (or more) of context
            assert len(w.tokens) - 1 - w.num_targets >= min(MAX_LEN - stride, n)


def test_stride_out_of_range_is_refused():
    with pytest.raises(ValueError, match="stride=17"):
        rolling_windows([1, 2, 3], MAX_LEN, 17)


def test_disjoint_windows_match_lm_evaluation_harness():
    utils = pytest.importorskip("lm_eval.utils")
    seq = list(range(1, 50))
    ours = [
        (list(w.tokens[:-1]), list(w.tokens[-w.num_targets :]))
        for w in rolling_windows([0, *seq], MAX_LEN, MAX_LEN)
    ]
    theirs = [
        utils.make_disjoint_window(p) for p in utils.get_rolling_token_windows(seq, 0, MAX_LEN, 1)
    ]
    # Same targets per window; ours may give the last window more context.
    assert [t for _, t in ours] == [t for _, t in theirs]


@pytest.mark.parametrize("stride", [1, 7, 16])
def test_doc_that_fits_scores_as_one_full_context_pass(model, stride):
    seq = [0, *range(40, 40 + MAX_LEN)]  # EOD + 16 tokens: exactly one window
    (score,) = score_windows(model, rolling_windows(seq, MAX_LEN, stride), 4, "cpu")
    assert score.num_targets == MAX_LEN
    assert -score.logprob == pytest.approx(full_context_nll(model, seq), rel=1e-5)


def test_long_doc_with_stride_one_equals_the_per_token_loop(model):
    seq = [0, *torch.randint(1, 256, (45,), generator=torch.Generator().manual_seed(0)).tolist()]
    scores = score_windows(model, rolling_windows(seq, MAX_LEN, 1), 8, "cpu")
    nll = -sum(s.logprob for s in scores)
    assert nll == pytest.approx(per_token_nll(model, seq, MAX_LEN), rel=1e-5)


@pytest.mark.parametrize("stride", [4, 16])
def test_long_doc_with_a_larger_stride_is_close_to_maximal_context(model, stride):
    seq = [0, *torch.randint(1, 256, (45,), generator=torch.Generator().manual_seed(1)).tolist()]
    nll = -sum(
        s.logprob for s in score_windows(model, rolling_windows(seq, MAX_LEN, stride), 8, "cpu")
    )
    best = per_token_nll(model, seq, MAX_LEN)
    assert nll != pytest.approx(best, rel=1e-7)  # shorter contexts do change the score...
    assert nll == pytest.approx(best, rel=0.05)  # ...but not by much
    # The first max_len targets always see their whole prefix.
    first = score_windows(model, rolling_windows(seq, MAX_LEN, stride)[:1], 1, "cpu")[0]
    assert -first.logprob == pytest.approx(full_context_nll(model, seq[: MAX_LEN + 1]), rel=1e-5)


def test_batching_and_padding_do_not_change_scores(model):
    gen = torch.Generator().manual_seed(2)
    seqs = [[0, *torch.randint(1, 256, (n,), generator=gen).tolist()] for n in (3, 16, 9, 30)]
    windows = [w for s in seqs for w in rolling_windows(s, MAX_LEN, 5)]
    one = score_windows(model, windows, 1, "cpu")
    many = score_windows(model, windows, 4, "cpu")
    for a, b in zip(one, many):
        assert a.logprob == pytest.approx(b.logprob, rel=1e-5)
        assert a.greedy == b.greedy


def test_continuation_window_keeps_the_end_of_a_long_context():
    w = continuation_window(list(range(30)), [100, 101], MAX_LEN)
    assert w.tokens == (*range(15, 30), 100, 101) and w.num_targets == 2
    with pytest.raises(ValueError, match="does not fit"):
        continuation_window([1], list(range(17)), MAX_LEN)


def test_perplexity_matches_transformers_on_the_same_weights(model, chars):
    hf = GPTNeoXForCausalLM(GPTNeoXConfig(**hf_config_for(CFG, VOCAB, "gpt_neox"))).eval()
    on_disk = to_hf_state_dict(model.state_dict(), CFG, VOCAB, "gpt_neox")
    # transformers >= 5 calls the output layer lm_head in memory (embed_out in files).
    hf.load_state_dict({k.replace("embed_out.", "lm_head."): v for k, v in on_disk.items()})
    texts = ["short one", "a document longer than sixteen characters, scored in windows"]
    docs = [(chars.encode(t), len(t.encode())) for t in texts]
    sums = score_texts(
        model, docs, eod=chars.eod, max_len=MAX_LEN, stride=MAX_LEN, batch_size=2, device="cpu"
    )
    # Reference: transformers, window by window as lm-evaluation-harness cuts them.
    ref = 0.0
    with torch.no_grad():
        for ids, _ in docs:
            for w in rolling_windows([chars.eod, *ids], MAX_LEN, MAX_LEN):
                x = torch.tensor([w.tokens])
                lp = torch.log_softmax(hf(x[:, :-1]).logits[0].double(), -1)
                targets = x[0, -w.num_targets :]
                ref -= lp[-w.num_targets :].gather(-1, targets[:, None]).sum().item()
    assert sums.nll == pytest.approx(ref, rel=1e-5)
    assert sums.tokens == sum(len(t) for t in texts) and sums.documents == 2
    metrics = text_metrics(sums)
    assert metrics["perplexity"] == pytest.approx(math.exp(ref / sums.tokens), rel=1e-5)


def test_bits_per_byte_counts_utf8_bytes():
    assert bits_per_byte(math.log(2) * 10, 10) == pytest.approx(1.0)
    text = "naïve café"  # 10 characters, 12 bytes
    m = text_metrics(
        TextSums(nll=12 * math.log(2) * 3, tokens=4, bytes=len(text.encode()), documents=1)
    )
    assert m["bytes"] == 12 and m["bits_per_byte"] == pytest.approx(3.0)
    assert m["perplexity"] == pytest.approx(math.exp(9 * math.log(2)))
    with pytest.raises(ValueError, match="no tokens"):
        text_metrics(TextSums())


def test_long_windows_score_a_slice_of_rows_at_a_time(model):
    """The log-softmax over 3 scored positions at a time (as at 128k context, SCORE_ROWS)
    gives the whole window's score."""
    seq = [0, *torch.randint(1, 256, (30,), generator=torch.Generator().manual_seed(3)).tolist()]
    windows = rolling_windows(seq, MAX_LEN, 5)
    whole = score_windows(model, windows, 4, "cpu")
    sliced = score_windows(model, windows, 4, "cpu", rows=3)
    for a, b in zip(whole, sliced):
        assert a.logprob == pytest.approx(b.logprob, rel=1e-9)
        assert a.greedy == b.greedy
