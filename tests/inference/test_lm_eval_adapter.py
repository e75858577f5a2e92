"""The lm-evaluation-harness adapter: each LM method against neox's own scores, and a harness task
read from a local file (no download) against neox's LAMBADA."""

import json

import pytest

from neox.inference.lambada import lambada_metrics, score_lambada, split_last_word
from neox.inference.perplexity import score_texts
from neox.inference.scoring import continuation_window, encode_pair, score_windows
from tests.inference.conftest import KNOWN

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from neox.inference.lm_eval_adapter import NeoXLM  # noqa: E402

MAX_LEN = 48


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.fixture(scope="module")
def lm(memorised, chars):
    return NeoXLM(memorised, chars, max_len=MAX_LEN, batch_size=3)


def test_loglikelihood_is_the_continuation_score(lm, memorised, chars):
    pairs = [split_last_word(t) for t in KNOWN] + [("the lazy", " cat"), ("", "a stitch")]
    got = lm.loglikelihood([request("loglikelihood", *p) for p in pairs])
    for (ctx, cont), (logprob, greedy) in zip(pairs, got):
        (want,) = score_windows(
            memorised, [continuation_window(*encode_pair(chars, ctx, cont), MAX_LEN)], 1, "cpu"
        )
        assert logprob == pytest.approx(want.logprob, rel=1e-5) and greedy == want.greedy
    assert [g for _, g in got[:3]] == [True, True, False]  # memorised endings; not the cat


def test_loglikelihood_rolling_is_the_document_score(lm, memorised, chars):
    texts = [KNOWN[0], KNOWN[1] * 4]  # the second needs several windows
    got = lm.loglikelihood_rolling([request("loglikelihood_rolling", t) for t in texts])
    for text, logprob in zip(texts, got):
        sums = score_texts(
            memorised,
            [(chars.encode(text), 0)],
            eod=chars.eod,
            max_len=MAX_LEN,
            stride=MAX_LEN,
            batch_size=1,
            device="cpu",
        )
        assert -logprob == pytest.approx(sums.nll, rel=1e-5)


def test_generate_until_continues_greedily_and_stops(lm):
    out = lm.generate_until(
        [
            request(
                "generate_until", "the quick brown fox jumps over the lazy", {"max_gen_toks": 4}
            ),
            request("generate_until", "a stitch in", {"until": [" saves"], "max_gen_toks": 20}),
        ]
    )
    assert out == [" dog", " time"]


def test_a_local_harness_task_matches_neox_lambada(tmp_path, memorised, chars, lm):
    """lambada_openai's task definition on a local jsonl, run by lm_eval.simple_evaluate."""
    data = tmp_path / "mini_lambada.jsonl"
    texts = [*KNOWN, "the quick brown fox jumps over the lazy cat"]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    task = {
        "task": "mini_lambada",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "output_type": "loglikelihood",
        "test_split": "test",
        "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
        "doc_to_target": "{{' '+text.split(' ')[-1]}}",
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    # A task given as a dict: the harness's own task index (10 s to build) is not needed.
    none = TaskManager(include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=[task], bootstrap_iters=0, log_samples=False, task_manager=none
    )
    got = out["results"]["mini_lambada"]
    want = lambada_metrics(
        score_lambada(memorised, chars, texts, max_len=MAX_LEN, batch_size=2, device="cpu")
    )
    assert got["acc,none"] == pytest.approx(want["accuracy"]) == pytest.approx(2 / 3)
    assert got["perplexity,none"] == pytest.approx(want["perplexity"], rel=1e-5)
