"""Tests for neox/prep/preprocess.py with the real GPT-2 BPE and 20B tokenizers."""

import json
import os
import struct
import threading

import numpy as np
import pytest
import zstandard

from neox.data.indexed import IndexedDataset, merge_datasets
from neox.prep.preprocess import PreprocessConfig, TextEncoder, preprocess
from neox.prep.readers import InputError


def corpus_lines(shared_data, n=40):
    """Real documents: LAMBADA passages, Shakespeare chunks, and a few awkward ones."""
    lines = (shared_data / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()[:n]
    shakespeare = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")
    lines += [json.dumps({"text": shakespeare[i : i + 3000]}) for i in range(0, 30000, 3000)]
    lines += [
        json.dumps({"text": ["para one", "para two ünïcödé 日本語"]}, ensure_ascii=False),
        json.dumps("a bare string document"),
        json.dumps({"text": "eod inside <|endoftext|> the text  \t\n  spaces   "}),
        json.dumps({"text": " "}),
        json.dumps({"text": "emoji 🤗 and é"}, ensure_ascii=False),
    ]
    return lines


def texts_of(lines):
    out = []
    for line in lines:
        obj = json.loads(line)
        text = obj if isinstance(obj, str) else obj["text"]
        out.append("\n\n".join(text) if isinstance(text, list) else text)
    return out


def gpt2_config(shared_data, inputs, prefix, **kw):
    return PreprocessConfig(
        inputs=str(inputs),
        output_prefix=str(prefix),
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(shared_data / "gpt2-vocab.json"),
        merge_file=str(shared_data / "gpt2-merges.txt"),
        progress=False,
        **kw,
    )


def expected_dataset(ids_per_doc, code, fmt):
    """.bin/.idx bytes built from the format spec: header, sizes, pointers, doc_idx, tokens."""
    sizes = [len(ids) for ids in ids_per_doc]
    n = len(sizes)
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * struct.calcsize(fmt)
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, n, n + 1)
    idx += struct.pack(f"<{n}i", *sizes) + struct.pack(f"<{n}q", *pointers)
    idx += struct.pack(f"<{n + 1}q", *range(n + 1))
    flat = [t for ids in ids_per_doc for t in ids]
    return struct.pack(f"<{len(flat)}{fmt}", *flat), idx


@pytest.fixture
def corpus(tmp_path, shared_data):
    lines = corpus_lines(shared_data)
    path = tmp_path / "corpus.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
    return path, lines


@pytest.mark.parametrize("workers", [0, 2])
def test_gpt2_bytes_match_spec_and_reference_tokenizer(tmp_path, shared_data, corpus, workers):
    from transformers import GPT2TokenizerFast

    path, lines = corpus
    ref = GPT2TokenizerFast(
        vocab=str(shared_data / "gpt2-vocab.json"), merges=str(shared_data / "gpt2-merges.txt")
    )
    ids = [ref(t)["input_ids"] + [50256] for t in texts_of(lines)]
    prefix = tmp_path / "out"
    cfg = gpt2_config(shared_data, path, prefix, append_eod=True, workers=workers, batch_bytes=4096)
    report = preprocess(cfg)
    want_bin, want_idx = expected_dataset(ids, code=8, fmt="H")  # uint16 for a 50257 vocab
    assert open(f"{prefix}_text_document.bin", "rb").read() == want_bin
    assert open(f"{prefix}_text_document.idx", "rb").read() == want_idx
    assert report.documents_read == len(lines) == report.documents_written["text"]
    assert report.tokens_written["text"] == sum(map(len, ids))
    assert report.issues.total == 0
    assert sorted(os.listdir(tmp_path)) == [
        "corpus.jsonl.zst",
        "out_text_document.bin",
        "out_text_document.idx",
    ]


def test_hf_20b_tokenizer_matches_tokenizers_library(tmp_path, shared_data, corpus):
    from tokenizers import Tokenizer

    path, lines = corpus
    ref = Tokenizer.from_file(str(shared_data / "20B_tokenizer.json"))
    ids = [e.ids for e in ref.encode_batch(texts_of(lines))]
    cfg = PreprocessConfig(
        inputs=str(path),
        output_prefix=str(tmp_path / "out"),
        tokenizer_type="HFTokenizer",
        vocab_file=str(shared_data / "20B_tokenizer.json"),
        progress=False,
    )
    preprocess(cfg)
    want_bin, want_idx = expected_dataset(ids, code=8, fmt="H")
    assert (tmp_path / "out_text_document.bin").read_bytes() == want_bin
    assert (tmp_path / "out_text_document.idx").read_bytes() == want_idx


BAD = [
    '{"text": "fine"}',
    '{"text": "cut',
    '{"title": "no text"}',
    '{"text": ""}',
    '{"text": "also fine"}',
]


def test_bad_input_is_reported_and_strict_leaves_nothing(tmp_path, shared_data):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(BAD) + "\n")
    report = preprocess(gpt2_config(shared_data, path, tmp_path / "out", workers=0))
    assert report.documents_read == 5 and report.documents_written["text"] == 2
    assert report.issues.counts == {
        "malformed JSON": 1,
        "missing key 'text'": 1,
        "empty document": 1,
    }
    text = report.format()
    assert f"{path}:2: malformed JSON" in text and f"{path}:4: empty document" in text
    before = {
        p: open(p, "rb").read()
        for p in (tmp_path / "out_text_document.bin", tmp_path / "out_text_document.idx")
    }
    with pytest.raises(InputError, match=r"in\.jsonl:2: malformed JSON"):
        preprocess(
            gpt2_config(shared_data, path, tmp_path / "out", strict=True, overwrite=True, workers=2)
        )
    # The failed run left no temp files and did not touch the earlier dataset.
    assert sorted(os.listdir(tmp_path)) == [
        "in.jsonl",
        "out_text_document.bin",
        "out_text_document.idx",
    ]
    assert {p: open(p, "rb").read() for p in before} == before


def test_existing_output_is_refused_before_work(tmp_path, shared_data):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "hello"}\n')
    preprocess(gpt2_config(shared_data, path, tmp_path / "out", workers=0))
    with pytest.raises(
        FileExistsError, match="out_text_document.bin/.idx already exists.*--overwrite"
    ):
        preprocess(gpt2_config(shared_data, path, tmp_path / "out", workers=0))
    path.write_text('{"text": "hello world, replaced"}\n')
    preprocess(gpt2_config(shared_data, path, tmp_path / "out", workers=0, overwrite=True))
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))[0]) == 4


def test_corrupt_second_file_aborts_without_output(tmp_path, shared_data, corpus):
    path, _ = corpus
    broken = tmp_path / "broken.jsonl.zst"
    broken.write_bytes(path.read_bytes()[:-20])
    cfg = gpt2_config(
        shared_data, f"{path},{broken}", tmp_path / "out", workers=2, batch_bytes=2048
    )
    with pytest.raises(InputError, match="broken.jsonl.zst is truncated"):
        preprocess(cfg)
    assert sorted(os.listdir(tmp_path)) == ["broken.jsonl.zst", "corpus.jsonl.zst"]


def test_shards_merge_back_to_the_unsharded_dataset(tmp_path, shared_data, corpus):
    path, lines = corpus
    whole = tmp_path / "whole"
    preprocess(gpt2_config(shared_data, path, whole, append_eod=True, workers=0))
    sharded = tmp_path / "shards" / "part"
    sharded.parent.mkdir()
    report = preprocess(
        gpt2_config(
            shared_data,
            path,
            sharded,
            append_eod=True,
            workers=2,
            max_shard_tokens=3000,
            batch_bytes=4096,
        )
    )
    shards = report.outputs["text"]
    assert len(shards) > 3
    for s in shards:
        ds = IndexedDataset(s)
        assert ds.num_tokens <= 3000 or len(ds) == 1
    merge_datasets(str(sharded.parent), str(tmp_path / "merged"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (
            tmp_path / f"whole_text_document{ext}"
        ).read_bytes()


def test_several_jsonl_keys_write_several_datasets(tmp_path, shared_data):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "body one", "title": "One"}\n{"text": "body two", "title": "Two"}\n')
    report = preprocess(
        gpt2_config(shared_data, path, tmp_path / "o", jsonl_keys=("text", "title"), workers=0)
    )
    assert report.documents_written == {"text": 2, "title": 2}
    titles = IndexedDataset(str(tmp_path / "o_title_document"))
    assert titles[1].tolist() == [7571]  # "Two"


class _UnpicklableError(ValueError):
    def __init__(self, what: str):
        super().__init__(what)
        self.lock = threading.Lock()  # cannot cross a pipe


class _FailingEncoder(TextEncoder):
    def encode(self, batch):
        raise _UnpicklableError("a document this encoder refuses")


def test_a_worker_error_that_cannot_travel_still_names_itself(tmp_path):
    """A worker's error reaches the parent as raised there, or in words when it does not pickle."""
    (tmp_path / "c.jsonl").write_text('{"text": "hi"}\n')
    cfg = PreprocessConfig(
        inputs=str(tmp_path / "c.jsonl"),
        output_prefix=str(tmp_path / "o"),
        tokenizer_type="CharLevelTokenizer",
        workers=1,
        progress=False,
    )
    with pytest.raises(RuntimeError, match="_UnpicklableError: a document this encoder refuses"):
        preprocess(cfg, _FailingEncoder(cfg, np.dtype(np.int32)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
