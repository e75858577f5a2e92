"""Tests for neox/prep/readers.py: formats, file:line accounting of bad input, corrupt files."""

import gzip
import io
import json
import lzma
import tarfile

import lm_dataformat
import pytest
import zstandard

from neox.prep.readers import (
    InputError,
    Issues,
    expand_inputs,
    iter_documents,
    iter_raw_batches,
    parse_batch,
)

DOCS = [{"text": f"document {i} ünï 日本 " * (i + 1), "title": f"t{i}"} for i in range(50)]


def jsonl_bytes(docs):
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()


def texts(inputs, keys=("text",), **kw):
    return [d for d in iter_documents(inputs, keys, **kw)]


@pytest.mark.parametrize(
    "name,compress",
    [
        ("a.jsonl", lambda b: b),
        ("a.jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
        ("a.jsonl.gz", gzip.compress),
        ("a.jsonl.xz", lzma.compress),
    ],
)
def test_compressed_jsonl_round_trip(tmp_path, name, compress):
    path = tmp_path / name
    path.write_bytes(compress(jsonl_bytes(DOCS)))
    assert texts(str(path)) == [{"text": d["text"]} for d in DOCS]


@pytest.mark.parametrize(
    "name,compress",
    [
        ("a.jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
        ("a.jsonl.gz", gzip.compress),
        ("a.jsonl.xz", lzma.compress),
    ],
)
def test_truncated_compressed_file_is_an_error_naming_it(tmp_path, name, compress):
    data = compress(jsonl_bytes(DOCS * 20))
    path = tmp_path / name
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(InputError, match=f"{name} is truncated or corrupt"):
        texts(str(path))


def test_concatenated_zstd_frames(tmp_path):
    c = zstandard.ZstdCompressor()
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(c.compress(jsonl_bytes(DOCS[:10])) + c.compress(jsonl_bytes(DOCS[10:])))
    assert len(texts(str(path))) == 50


def test_lm_dataformat_archive_and_tar(tmp_path):
    # A real lm_dataformat writer: {"text", "meta"} lines in a .jsonl.zst.
    archive = lm_dataformat.Archive(str(tmp_path / "lmd"))
    for d in DOCS[:5]:
        archive.add_data(d["text"], meta={"title": d["title"]})
    archive.commit()
    assert texts(str(tmp_path / "lmd")) == [{"text": d["text"]} for d in DOCS[:5]]
    # lm_dataformat's tar of .jsonl.zst members.
    tar_path = tmp_path / "b.jsonl.zst.tar"
    with tarfile.open(tar_path, "w") as tar:
        for i, chunk in enumerate((DOCS[:3], DOCS[3:7])):
            data = zstandard.ZstdCompressor().compress(jsonl_bytes(chunk))
            info = tarfile.TarInfo(f"part{i}.jsonl.zst")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert texts(str(tar_path)) == [{"text": d["text"]} for d in DOCS[:7]]


def test_text_file_is_one_document(tmp_path, shared_data):
    shakespeare = shared_data / "tinyshakespeare.txt"
    docs = texts(str(shakespeare))
    assert docs == [{"text": shakespeare.read_text(encoding="utf-8")}]


def test_expand_inputs_dirs_globs_lists(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for rel in ("d/b.jsonl", "d/a.jsonl.zst", "d/sub/c.txt", "d/notes.md", "e.jsonl"):
        (tmp_path / rel).write_bytes(b"")
    d = str(tmp_path / "d")
    got = expand_inputs(f"{d},{tmp_path}/*.jsonl,{d}/b.jsonl")
    names = [p[len(str(tmp_path)) + 1 :] for p in got]
    assert names == ["d/a.jsonl.zst", "d/b.jsonl", "d/sub/c.txt", "e.jsonl"]
    with pytest.raises(InputError, match="does not exist"):
        expand_inputs(str(tmp_path / "missing.jsonl"))
    with pytest.raises(InputError, match="matches no file"):
        expand_inputs(str(tmp_path / "*.parquet"))
    with pytest.raises(InputError, match="unsupported extension"):
        expand_inputs(str(tmp_path / "d" / "notes.md"))


BAD_LINES = [
    b'{"text": "good one", "title": "x"}',
    b'{"text": "broken',  # line 2
    b'{"text": "bad \xff byte"}',  # line 3
    b'{"title": "no text"}',  # line 4
    b'{"text": ""}',  # line 5
    b"",  # line 6: blank
    b'{"text": 42}',  # line 7
    b"[1, 2]",  # line 8
    b'{"text": "lone \\ud800 surrogate"}',  # line 9
    b'"a bare string"',  # line 10
    b'{"text": ["para a", "para b"], "title": "y"}',  # line 11
]


def test_bad_lines_are_counted_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(BAD_LINES) + b"\n")
    issues = Issues(max_examples=20)
    docs = texts(str(path), issues=issues)
    assert docs == [{"text": "good one"}, {"text": "a bare string"}, {"text": "para a\n\npara b"}]
    assert issues.counts == {
        "malformed JSON": 1,
        "invalid UTF-8": 2,
        "missing key 'text'": 1,
        "empty document": 1,
        "blank line": 1,
        "key 'text' is not text": 1,
        "not a JSON object": 1,
    }
    where = [e.split(": ")[0] for e in issues.examples]
    assert where == [f"{path}:{n}" for n in (2, 3, 4, 5, 6, 7, 8, 9)]


def test_strict_stops_at_first_bad_document(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(BAD_LINES))
    with pytest.raises(InputError, match=r"bad\.jsonl:2: malformed JSON.*without --strict"):
        texts(str(path), strict=True)


def test_several_keys(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"\n".join(BAD_LINES))
    issues = Issues()
    docs = texts(str(path), keys=("text", "title"), issues=issues)
    assert docs[0] == {"text": "good one", "title": "x"}
    assert {"title": "no text"} in docs
    assert issues.counts["missing key 'title'"] == 3  # lines 5, 7 and 9


def test_line_numbers_across_small_batches(tmp_path):
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(200)]
    lines[137] = "{oops"
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines))  # no final newline
    issues = Issues()
    batches = list(iter_raw_batches([str(path)], batch_bytes=100))
    assert len(batches) > 10
    n = 0
    for b in batches:
        parsed = parse_batch(b)
        issues.merge(parsed.issues)
        n += len(parsed.texts["text"])
    assert n == 199
    assert issues.examples[0].startswith(f"{path}:138: malformed JSON")
    assert sum(b.disk_bytes for b in batches) == path.stat().st_size
