"""tools/preprocess_data.py run as a user runs it: `python tools/preprocess_data.py` from the repo root."""

import json
import subprocess
import sys
from pathlib import Path

from neox.data.indexed import IndexedDataset
from neox.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args):
    return subprocess.run(
        [sys.executable, "tools/preprocess_data.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def gpt2_flags(shared_data):
    return [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(shared_data / "gpt2-vocab.json"),
        "--merge-file",
        str(shared_data / "gpt2-merges.txt"),
    ]


def test_cli_writes_dataset_and_report(tmp_path, shared_data):
    lines = (shared_data / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()[:30]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines[:20]) + "\n{broken\n")
    (tmp_path / "in" / "b.jsonl").write_text("\n".join(lines[20:]) + "\n")
    out = tmp_path / "out"
    res = run_tool(
        "--input",
        str(tmp_path / "in"),
        "--output-prefix",
        str(out),
        "--append-eod",
        "--workers",
        "2",
        "--no-progress",
        *gpt2_flags(shared_data),
    )
    assert res.returncode == 0, res.stderr
    assert "read 31 documents from 2 files" in res.stderr
    assert "wrote 30 documents" in res.stderr
    assert f"{tmp_path / 'in' / 'a.jsonl'}:21: malformed JSON" in res.stderr
    ds = IndexedDataset(f"{out}_text_document")
    assert len(ds) == 30 and all(ds[i][-1] == 50256 for i in range(30))
    tok = build_tokenizer("GPT2BPETokenizer", *gpt2_flags(shared_data)[3::2])
    assert ds[0].tolist() == tok.encode(json.loads(lines[0])["text"]) + [tok.eod]


def test_cli_bad_input_exits_1_with_the_reason(tmp_path, shared_data):
    res = run_tool(
        "--input",
        str(tmp_path / "nope.jsonl"),
        "--output-prefix",
        str(tmp_path / "o"),
        *gpt2_flags(shared_data),
    )
    assert res.returncode == 1
    assert "nope.jsonl does not exist" in res.stderr and "Traceback" not in res.stderr
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    res = run_tool(
        "--input",
        str(tmp_path / "x.jsonl"),
        "--output-prefix",
        str(tmp_path / "o"),
        "--strict",
        *gpt2_flags(shared_data),
    )
    assert res.returncode == 1
    assert "x.jsonl:2: missing key 'text'" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]
