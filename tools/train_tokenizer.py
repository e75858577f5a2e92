"""Train a byte-level BPE tokenizer (tokenizers JSON, for tokenizer_type HFTokenizer).

Example:
    python tools/train_tokenizer.py data/pystdlib/pystdlib.jsonl.zst --vocab-size 2048 \\
        --output data/pystdlib/tokenizer.json
Inputs are jsonl (plain or .zst/.gz/.xz), text files (one document each), directories or globs.
"""

from __future__ import annotations

import argparse
import logging
import shlex

from neox.data.readers import InputError
from neox.tokenizer import HFTokenizer
from neox.tokenizer.train import DEFAULT_SPECIAL_TOKENS, train_bpe_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = train_bpe_tokenizer(
            args.inputs,
            args.output,
            vocab_size=args.vocab_size,
            special_tokens=args.special_tokens,
            jsonl_key=args.jsonl_key,
            progress=not args.no_progress,
        )
        tokenizer = HFTokenizer(str(path))
    except (ValueError, FileNotFoundError, InputError) as err:
        raise SystemExit(f"train_tokenizer: error: {err}") from None
    print(f"wrote {path} ({tokenizer.vocab_size} tokens, eod id {tokenizer.eod})")
    print("use it with: --tokenizer-type HFTokenizer --vocab-file " + shlex.quote(str(path)))


if __name__ == "__main__":
    main()
