"""Sampling filters, and padded vocabulary rows never chosen whatever their logits."""

import pytest
import torch

from neox.inference.sampling import SamplingParams, filter_top_k, filter_top_p, sample

VOCAB = 10


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=5.0, top_k=3),
        SamplingParams(temperature=2.0, top_p=0.9),
    ],
    ids=["greedy", "t1", "topk", "topp"],
)
def test_padded_rows_are_never_sampled_even_when_most_likely(params):
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    logits[:, VOCAB:] = 50.0  # padded ids 10..15 dominate
    rng = torch.Generator().manual_seed(1)
    for _ in range(20):
        assert int(sample(logits, params, VOCAB, rng).max()) < VOCAB


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = filter_top_k(logits, 2)
    assert torch.isfinite(kept).tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    kept = torch.isfinite(filter_top_p(probs.log(), 0.8)).tolist()
    assert kept == [[True, False, True, False]]  # 0.5 + 0.3 reaches 0.8
    kept = torch.isfinite(filter_top_p(probs.log(), 0.81)).tolist()
    assert kept == [[True, False, True, True]]
    kept = torch.isfinite(filter_top_p(probs.log(), 0.1)).tolist()
    assert kept == [[True, False, False, False]]  # the most likely id always stays


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).log_softmax(-1).expand(20000, 3)
    draws = sample(logits, SamplingParams(temperature=1.0), 3, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.0, 1.0, 2.0]).softmax(-1), atol=0.02, rtol=0)


@pytest.mark.parametrize(
    "kwargs,word", [({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p")]
)
def test_bad_params_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_temperature_zero_with_top_k_samples_unscaled_like_gpt_neox():
    logits = torch.zeros(4000, 5)
    logits[:, 0], logits[:, 1] = 1.0, 0.5
    params = SamplingParams(temperature=0.0, top_k=2)
    draws = sample(logits, params, 5, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 1}  # the top 2, not the argmax only
    assert SamplingParams().greedy and not params.greedy


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
    ids=["t1", "filtered"],
)
def test_sampling_draws_what_torch_multinomial_draws(params):
    """The sync-free draw (argmax of probs / Exp(1)) picks multinomial's ids from the same
    generator, so seeded runs sample as they did with torch.multinomial."""
    from neox.inference.sampling import filter_top_k, filter_top_p, mask_padded_vocab

    logits = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    ours, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(10):
        got = sample(logits, params, VOCAB, ours)
        x = mask_padded_vocab(logits, VOCAB)
        x = x / params.temperature
        x = filter_top_p(filter_top_k(x, params.top_k), params.top_p) if params.top_k else x
        want = torch.multinomial(x.softmax(-1), 1, generator=theirs).squeeze(-1)
        assert torch.equal(got, want)
