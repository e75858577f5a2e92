"""Tokenize jsonl / text corpora into indexed datasets for training (gpt-neox's flags).

Example:
    python tools/preprocess_data.py --input data/*.jsonl.zst --output-prefix data/pile \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 8
writes data/pile_text_document.bin/.idx; use data/pile_text_document as a data path.
"""

from __future__ import annotations

import argparse
import logging
import sys

from neox.prep.tool import (
    add_count_args,
    add_input_group,
    add_output_and_runtime_args,
    add_tokenizer_args,
    config_from_args,
    run_preprocess,
    tokenizer_fields,
)

logger = logging.getLogger("preprocess_data")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = add_input_group(p, "keys to tokenize; one dataset each")
    add_count_args(g)
    add_tokenizer_args(p)
    add_output_and_runtime_args(p, "<prefix>_<key>_document.bin/.idx")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_preprocess(logger, lambda: config_from_args(args, **tokenizer_fields(args)))


if __name__ == "__main__":
    sys.exit(main())
