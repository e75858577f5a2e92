"""eval.py's pieces that need no ranks: document shards, split documents, inputs, results file."""

import json

import pytest

from neox.config import load_dict
from neox.inference.evaluation import (
    file_texts,
    results_path,
    split_documents_of,
    split_texts,
    take_shard,
    write_results,
)
from neox.prep.readers import InputError
from neox.tokenizer import build_tokenizer
from tests.train_helpers import make_dataset


def test_shards_cover_the_limited_documents_once():
    docs = list(range(10))
    shards = [take_shard(iter(docs), 7, rank, 3) for rank in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]
    assert take_shard(iter([1]), None, 1, 2) == []  # more ranks than documents


def test_split_documents_follow_the_training_split(tmp_path):
    make_dataset(tmp_path / "chars", docs=20)
    cfg = load_dict({"data_path": str(tmp_path / "chars"), "split": "8,1,1"})
    valid, test = list(split_documents_of(cfg, "valid")), list(split_documents_of(cfg, "test"))
    assert len(valid) == 2 and len(test) == 2
    chars = build_tokenizer("CharLevelTokenizer", None, None)
    for (ids, nbytes), tokens in zip(split_texts(cfg, "valid", chars), valid):
        assert tokens[-1] == chars.eod and ids == [int(t) for t in tokens[:-1]]
        assert nbytes == len(chars.decode(ids).encode())
    per_split = load_dict({"valid_data_paths": [str(tmp_path / "chars")] * 2})
    assert len(list(split_documents_of(per_split, "valid"))) == 40


def test_a_bad_line_in_an_eval_file_names_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(InputError, match=r"docs.jsonl:2: key 'text' is not text"):
        list(file_texts(str(path), "text"))


def test_results_file_is_named_by_prefix_in_log_dir(tmp_path):
    cfg = load_dict({"log_dir": str(tmp_path / "logs"), "eval_results_prefix": "step9"})
    path = write_results(results_path(cfg), {"results": {"a": 1.0}})
    assert path.parent == tmp_path / "logs" and path.name.startswith("step9_eval_results_")
    assert json.loads(path.read_text()) == {"results": {"a": 1.0}}
    assert not list(path.parent.glob("*.tmp"))
