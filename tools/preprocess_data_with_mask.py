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
import signal
import sys

from neox.data.indexed import best_dtype
from neox.prep.masking import MaskEncoder, parse_token_pattern
from neox.prep.preprocess import PreprocessConfig, preprocess
from neox.prep.readers import SUPPORTED_SUFFIXES
from neox.tokenizer import TOKENIZER_TYPES, build_tokenizer

logger = logging.getLogger("preprocess_data_with_mask")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument(
        "--input",
        required=True,
        help="comma-separated files, directories or globs (" + ", ".join(SUPPORTED_SUFFIXES) + ")",
    )
    g.add_argument("--jsonl-keys", nargs="+", default=["text"], help="keys to tokenize")
    g.add_argument(
        "--mask-before-token",
        default=None,
        help="token ids of the delimiter, e.g. 0,1,1270: labels are -100 up to and including "
        "its first occurrence (without it, no label dataset is written)",
    )
    g.add_argument(
        "--num-docs", type=int, default=None, help="expected documents, for the progress bar"
    )
    g.add_argument("--strict", action="store_true", help="stop at the first bad document")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument(
        "--append-eod", action="store_true", help="append the eod token to each document"
    )
    g.add_argument("--ftfy", action="store_true", help="fix text with ftfy before tokenizing")
    g = p.add_argument_group("output data")
    g.add_argument(
        "--output-prefix",
        required=True,
        help="writes <prefix>_<key>_document and <prefix>_label_document .bin/.idx",
    )
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="only mmap is written")
    g.add_argument("--max-shard-tokens", type=int, default=None, help="split output into shards")
    g.add_argument("--overwrite", action="store_true", help="replace existing output datasets")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes (0: in-process)")
    g.add_argument("--log-interval", type=int, default=100, help="documents between log lines")
    g.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    return p.parse_args(argv)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = PreprocessConfig(
        inputs=args.input,
        output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        jsonl_keys=tuple(args.jsonl_keys),
        append_eod=args.append_eod,
        ftfy=args.ftfy,
        workers=args.workers,
        strict=args.strict,
        log_interval=args.log_interval,
        num_docs=args.num_docs,
        max_shard_tokens=args.max_shard_tokens,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    try:
        encoder = None
        if args.mask_before_token is not None:
            pattern = parse_token_pattern(args.mask_before_token)
            tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
            encoder = MaskEncoder(config, pattern, best_dtype(tokenizer.vocab_size), tokenizer)
        report = preprocess(config, encoder)
    except (ValueError, OSError) as e:
        logger.error("%s: %s", type(e).__name__, e)
        logger.error("nothing was written (existing datasets are untouched)")
        return 1
    logger.info("done\n%s", report.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
