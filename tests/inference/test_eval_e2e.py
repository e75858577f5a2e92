"""eval.py on a checkpoint trained here: 2 CPU ranks (started from this process) give the scores
of one in-process pass; bad paths given to deepy.py stop before launch with one clear message."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from neox.config import load_config
from neox.inference.evaluation import load_eval_model, split_texts
from neox.inference.lambada import lambada_metrics, score_lambada
from neox.inference.perplexity import score_texts, text_metrics
from neox.prep.readers import iter_documents
from neox.tokenizer import build_tokenizer
from tests.train_helpers import ROOT, make_dataset, run_here, train, write_config

pytestmark = pytest.mark.slow

LONG = "a document much longer than the 32-token context, so it is scored in sliding windows " * 2
PASSAGES = ["the cat sat on the mat", "she opened the door and saw her brother"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step tiny char-level run on 2 ranks, its checkpoint, and eval inputs beside it."""
    tmp = tmp_path_factory.mktemp("eval")
    make_dataset(tmp / "data" / "chars")
    cfg = write_config(tmp, "run", train_iters=2, checkpoint_factor=2, eval_interval=100)
    train(cfg)
    docs = tmp / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["short text", LONG, "é ü"]))
    lambada = tmp / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in PASSAGES))
    # lambada_openai's harness definition, on the same local passages (no download).
    (tmp / "tasks").mkdir()
    task = {
        "task": "mini_lambada",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(lambada)}},
        "output_type": "loglikelihood",
        "test_split": "test",
        "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
        "doc_to_target": "{{' '+text.split(' ')[-1]}}",
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    (tmp / "tasks" / "mini_lambada.yaml").write_text(yaml.safe_dump(task))
    return tmp, cfg, docs, lambada


def eval_config(tmp: Path, name: str, **overrides) -> Path:
    path = tmp / f"{name}.yml"
    path.write_text(yaml.safe_dump(overrides))
    return path


def results_of(log_dir: Path, prefix: str) -> dict:
    (path,) = log_dir.glob(f"{prefix}_eval_results_*.json")
    return json.loads(path.read_text())


def test_two_ranks_match_in_process_scores(run):
    tmp, cfg, docs, lambada = run
    parts = dict(
        eval_split="valid",
        eval_input_file=str(docs),
        eval_lambada_file=str(lambada),
        eval_stride=8,
        eval_batch_size=3,
        eval_tasks=["mini_lambada"],
        eval_include_path=str(tmp / "tasks"),
    )
    two = eval_config(tmp, "two", eval_results_prefix="two", **parts)
    r = run_here("eval.py", cfg, two)

    log_dir = tmp / "run" / "logs"
    got = results_of(log_dir, "two")
    assert got["ranks"] == 2 and got["tag"] == "global_step2"
    assert got["results"].keys() == {"valid", "eval_input_file", "lambada", "lm_eval"}

    # The ranks' summed shares equal the scores of all documents in one process.
    loaded = load_config([str(cfg), str(two)]).config
    model, _ = load_eval_model(loaded.checkpoint.load, None, torch.device("cpu"), torch.float32)
    chars = build_tokenizer("CharLevelTokenizer", None, None)
    common = dict(max_len=32, batch_size=4, device="cpu")
    texts = [d["text"] for d in iter_documents(str(docs))]
    file_docs = [(chars.encode(t), len(t.encode())) for t in texts]
    expect = text_metrics(score_texts(model, file_docs, eod=0, stride=8, **common))
    assert got["results"]["eval_input_file"]["bytes"] == sum(len(t.encode()) for t in texts)
    for key, value in expect.items():
        assert got["results"]["eval_input_file"][key] == pytest.approx(value, rel=1e-5), key
    valid = text_metrics(
        score_texts(model, list(split_texts(loaded, "valid", chars)), eod=0, stride=8, **common)
    )
    assert got["results"]["valid"]["documents"] == 6  # split 8,1,1 of 60 documents
    assert got["results"]["valid"]["perplexity"] == pytest.approx(valid["perplexity"], rel=1e-5)
    lam = lambada_metrics(score_lambada(model, chars, PASSAGES, **common))
    assert got["results"]["lambada"] == pytest.approx(lam, rel=1e-5)
    # The harness spread the passages over the 2 ranks and gathered the same metrics.
    harness = got["results"]["lm_eval"]["mini_lambada"]
    assert harness["acc,none"] == pytest.approx(lam["accuracy"])
    assert harness["perplexity,none"] == pytest.approx(lam["perplexity"], rel=1e-5)
    assert '"bits_per_byte"' in r.stdout  # the results are printed too


def test_missing_checkpoint_and_eval_file_stop_before_launch(run, capsys, monkeypatch):
    """deepy.py's main in this process: a refusal launches nothing (deepy.py's exit status 2 in
    its own process: tests/test_deepy.py)."""
    tmp, cfg, docs, _ = run
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import deepy

    bad = eval_config(
        tmp,
        "bad",
        load=str(tmp / "no_such_run"),
        eval_input_file=str(tmp / "missing.jsonl"),
        eval_lambada_file=str(tmp / "missing_lambada.jsonl"),
        eval_include_path=str(tmp / "no_tasks"),
        eval_stride=33,
        eval_tasks=["mini_lambada", "no_such_task"],
    )
    assert deepy.main(["eval.py", str(cfg), str(bad)]) == 2
    err = capsys.readouterr().err
    assert "load=" in err and "holds no checkpoint" in err
    assert "missing.jsonl does not exist" in err
    assert "eval_lambada_file=" in err and "missing_lambada.jsonl" in err
    assert "eval_include_path=" in err and "is not a directory" in err
    assert "eval_stride=33 exceeds seq_length=32" in err
    # mini_lambada is unknown too: its directory (eval_include_path) does not exist.
    assert "has no task 'mini_lambada', 'no_such_task'" in err
    nothing = eval_config(tmp, "nothing")
    assert deepy.main(["eval.py", str(cfg), str(nothing)]) == 2
    assert "eval.py has nothing to evaluate" in capsys.readouterr().err
