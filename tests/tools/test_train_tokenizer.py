"""tools/train_tokenizer.py run as a user runs it, from the repository root."""

import subprocess
import sys
from pathlib import Path

from neox.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tools/train_tokenizer.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_trains_a_tokenizer_hftokenizer_loads(shared_data, tmp_path):
    out = tmp_path / "tok.json"
    result = run_tool(
        str(shared_data / "tinyshakespeare.txt"),
        str(shared_data / "lambada_test.jsonl"),
        "--vocab-size",
        "700",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "--tokenizer-type HFTokenizer --vocab-file" in result.stdout
    assert "doc" in result.stderr  # the progress bar counts documents
    tok = build_tokenizer("HFTokenizer", str(out))
    assert (tok.vocab_size, tok.eod) == (700, 0)
    text = (shared_data / "tinyshakespeare.txt").read_text()[:3000]
    assert tok.decode(tok.encode(text)) == text


def test_cli_reports_bad_input_without_a_traceback(tmp_path):
    result = run_tool(str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "t.json"))
    assert result.returncode != 0
    assert "missing.jsonl" in result.stderr and "Traceback" not in result.stderr
