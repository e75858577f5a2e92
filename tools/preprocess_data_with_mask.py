"""Tokenize documents and write labels that mask everything up to a delimiter, e.g. the prompt
before "Answer:" (gpt-neox's preprocess_data_with_mask.py flags).

Example:
    python tools/preprocess_data_with_mask.py --input data/qa.jsonl --output-prefix data/qa \\
        --tokenizer-type HFTokenizer --vocab-file tokenizer.json --append-eod \\
        --mask-before-token 21350,25
writes data/qa_text_document.bin/.idx (tokens) and data/qa_label_document.bin/.idx (-100 up to
and including the first 21350,25 of each document, the token id after); train with
    train_data_paths: [data/qa_text_document]
    train_label_data_paths: [data/qa_label_document]
--mask-before-token is the delimiter as the tokenizer encodes it (comma-separated ids).
"""

from __future__ import annotations

import argparse
import logging
import sys

from neox.data.indexed import best_dtype
from neox.prep.masking import MaskEncoder, parse_token_pattern
from neox.prep.tool import (
    add_count_args,
    add_input_group,
    add_output_and_runtime_args,
    add_tokenizer_args,
    config_from_args,
    run_preprocess,
    tokenizer_fields,
)
from neox.tokenizer import build_tokenizer

logger = logging.getLogger("preprocess_data_with_mask")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = add_input_group(p, "keys to tokenize")
    g.add_argument(
        "--mask-before-token",
        default=None,
        help="token ids of the delimiter, e.g. 0,1,1270: labels are -100 up to and including "
        "its first occurrence (without it, no label dataset is written)",
    )
    add_count_args(g)
    add_tokenizer_args(p)
    add_output_and_runtime_args(p, "<prefix>_<key>_document and <prefix>_label_document .bin/.idx")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def encoder(config):
        if args.mask_before_token is None:
            return None
        pattern = parse_token_pattern(args.mask_before_token)
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
        return MaskEncoder(config, pattern, best_dtype(tokenizer.vocab_size), tokenizer)

    return run_preprocess(logger, lambda: config_from_args(args, **tokenizer_fields(args)), encoder)


if __name__ == "__main__":
    sys.exit(main())
