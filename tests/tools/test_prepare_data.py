"""tools/prepare_data.py: the offline default, the download failure, and the printed next steps."""

import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*command: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_default_corpus_then_printed_commands_build_a_dataset(tmp_path):
    result = run("tools/prepare_data.py", "--data-dir", str(tmp_path), "--size-mb", "0.2")
    assert result.returncode == 0, result.stderr
    corpus = tmp_path / "pystdlib" / "pystdlib.jsonl.zst"
    assert corpus.is_file() and f"wrote {corpus}" in result.stdout
    commands = [line.strip() for line in result.stdout.splitlines() if line.startswith("  python")]
    assert [shlex.split(c)[1] for c in commands] == [
        "tools/train_tokenizer.py",
        "tools/preprocess_data.py",
    ]
    for flag in ("--input", "--output-prefix", "--tokenizer-type", "--vocab-file", "--append-eod"):
        assert flag in commands[1]
    # The printed commands are the real next steps: run them as printed.
    for command in commands:
        argv = shlex.split(command)[1:]
        if argv[0] == "tools/train_tokenizer.py":
            argv[argv.index("--vocab-size") + 1] = "600"  # keep the test quick
        step = run(*argv)
        assert step.returncode == 0, f"{command}\n{step.stderr}"
    assert (tmp_path / "pystdlib" / "pystdlib_text_document.idx").is_file()


def test_given_tokenizer_goes_into_the_preprocess_command(tmp_path, shared_data):
    vocab, merges = shared_data / "gpt2-vocab.json", shared_data / "gpt2-merges.txt"
    result = run(
        "tools/prepare_data.py",
        str(shared_data / "tinyshakespeare.txt"),
        "--data-dir",
        str(tmp_path),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(vocab),
        "--merge-file",
        str(merges),
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "tinyshakespeare" / "tinyshakespeare.jsonl.zst").is_file()
    commands = [line.strip() for line in result.stdout.splitlines() if line.startswith("  python")]
    assert len(commands) == 1
    argv = shlex.split(commands[0])
    assert argv[argv.index("--merge-file") + 1] == str(merges)
    assert argv[argv.index("--output-prefix") + 1] == str(
        tmp_path / "tinyshakespeare" / "tinyshakespeare"
    )


def test_offline_download_fails_fast_and_says_what_to_do(tmp_path):
    start = time.monotonic()
    result = run(
        "tools/prepare_data.py",
        "enwik8",
        "--data-dir",
        str(tmp_path),
        "--url",
        "http://127.0.0.1:9/enwik8.zip",
        "--timeout",
        "2",
    )
    assert time.monotonic() - start < 20
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    for needed in ("'enwik8'", "http://127.0.0.1:9/enwik8.zip", "--url", "pystdlib"):
        assert needed in result.stderr
