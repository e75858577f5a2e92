"""Train a byte-level BPE tokenizer (tokenizers JSON, for tokenizer_type HFTokenizer).

Example:
    python tools/train_tokenizer.py data/pystdlib/pystdlib.jsonl.zst --vocab-size 2048 \\
        --output data/pystdlib/tokenizer.json
Inputs are jsonl (plain or .zst/.gz/.xz), text files (one document each), directories or globs.
"""

from __future__ import annotations

import argparse
import shlex

from neox.cli import exit_on, tool_parser
from neox.prep.readers import InputError
from neox.prep.tokenizer_training import DEFAULT_SPECIAL_TOKENS, train_bpe_tokenizer
from neox.tokenizer import HFTokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = tool_parser(__doc__)
    p.add_argument("inputs", nargs="+", help="files, directories or globs holding the text")
    p.add_argument("--output", required=True, help="path of the tokenizer JSON to write")
    p.add_argument(
        "--vocab-size", type=int, default=50257, help="tokens in the vocabulary (default 50257)"
    )
    p.add_argument(
        "--special-tokens",
        nargs="*",
        default=list(DEFAULT_SPECIAL_TOKENS),
        help="special tokens, given the first ids in this order (default: %(default)s)",
    )
    p.add_argument("--jsonl-key", default="text", help="jsonl key holding the text")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on("train_tokenizer", ValueError, FileNotFoundError, InputError):
        path = train_bpe_tokenizer(
            args.inputs,
            args.output,
            vocab_size=args.vocab_size,
            special_tokens=args.special_tokens,
            jsonl_key=args.jsonl_key,
            progress=not args.no_progress,
        )
        tokenizer = HFTokenizer(str(path))
    print(f"wrote {path} ({tokenizer.vocab_size} tokens, eod id {tokenizer.eod})")
    print("use it with: --tokenizer-type HFTokenizer --vocab-file " + shlex.quote(str(path)))


if __name__ == "__main__":
    main()
