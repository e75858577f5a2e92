"""Write a text corpus as jsonl.zst ({"text": ...} per line), ready for preprocess_data.py.

Examples:
    python tools/prepare_data.py                      # pystdlib: offline, ~5 MB of Python source
    python tools/prepare_data.py tinyshakespeare      # downloaded (enwik8, wikitext-103, ...)
    python tools/prepare_data.py my_texts/ more.jsonl --name mine   # local files, dirs, globs
Writes data/<name>/<name>.jsonl.zst and prints the commands that come next.
"""

from __future__ import annotations

import argparse
import shlex

from neox.cli import exit_on, tool_parser
from neox.prep.corpora import (
    CORPUS_NAMES,
    DEFAULT_CORPUS,
    DOWNLOAD_TIMEOUT_S,
    REMOTE_CORPORA,
    CorpusDownloadError,
    PreparedCorpus,
    prepare_corpus,
)
from neox.prep.readers import InputError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = "\n".join(
        [f"  {DEFAULT_CORPUS}: this Python's standard library sources (offline)"]
        + [f"  {c.name}: {c.about}" for c in REMOTE_CORPORA.values()]
    )
    p = tool_parser(__doc__)
    p.epilog = "corpora:\n" + names
    p.add_argument(
        "source",
        nargs="*",
        default=[DEFAULT_CORPUS],
        help=f"a corpus name ({', '.join(CORPUS_NAMES)}) or local files/dirs/globs",
    )
    p.add_argument("--name", help="corpus name for local inputs (default: first input's name)")
    p.add_argument(
        "--output", help="jsonl.zst to write (default: <data-dir>/<name>/<name>.jsonl.zst)"
    )
    p.add_argument("--data-dir", default="data", help="folder for corpora (default: data)")
    p.add_argument(
        "--size-mb",
        type=float,
        help="stop after this much text (default: 5 for pystdlib, 50 for pile-sample, else all)",
    )
    p.add_argument("--url", help="download a named corpus from this mirror instead")
    p.add_argument(
        "--timeout", type=float, default=DOWNLOAD_TIMEOUT_S, help="network timeout, seconds"
    )
    p.add_argument("--jsonl-key", default="text", help="jsonl key holding the text (local inputs)")
    g = p.add_argument_group("tokenizer for the printed preprocess command")
    g.add_argument("--tokenizer-type", help="e.g. GPT2BPETokenizer (default: train one first)")
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    return p.parse_args(argv)


def next_commands(prepared: PreparedCorpus, args: argparse.Namespace) -> list[str]:
    """The shell commands that turn the written corpus into a training dataset."""
    corpus = str(prepared.path)
    prefix = corpus.removesuffix(".jsonl.zst")
    commands = []
    tokenizer = ["--tokenizer-type", args.tokenizer_type or "HFTokenizer"]
    if args.tokenizer_type is None:
        vocab = str(prepared.path.parent / "tokenizer.json")
        train = ["python", "tools/train_tokenizer.py", corpus, "--vocab-size", "2048"]
        commands.append(shlex.join(train + ["--output", vocab]))
        tokenizer += ["--vocab-file", vocab]
    else:
        tokenizer += ["--vocab-file", args.vocab_file] if args.vocab_file else []
        tokenizer += ["--merge-file", args.merge_file] if args.merge_file else []
    preprocess = ["python", "tools/preprocess_data.py", "--input", corpus]
    preprocess += ["--output-prefix", prefix, *tokenizer, "--append-eod"]
    commands.append(shlex.join(preprocess))
    return commands


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on("prepare_data", CorpusDownloadError, ValueError, FileNotFoundError, InputError):
        prepared = prepare_corpus(
            args.source,
            args.output,
            data_dir=args.data_dir,
            name=args.name,
            size_mb=args.size_mb,
            url=args.url,
            timeout=args.timeout,
            jsonl_key=args.jsonl_key,
        )
    mb = prepared.text_bytes / 1e6
    print(f"wrote {prepared.path}: {prepared.documents} documents, {mb:.1f} MB of text")
    print("next:")
    for command in next_commands(prepared, args):
        print("  " + command)


if __name__ == "__main__":
    main()
