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
import signal
import sys

from neox.prep.preprocess import PreprocessConfig, preprocess
from neox.prep.readers import SUPPORTED_SUFFIXES
from neox.tokenizer import TOKENIZER_TYPES

logger = logging.getLogger("preprocess_data")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument(
        "--input",
        required=True,
        help="comma-separated files, directories or globs (" + ", ".join(SUPPORTED_SUFFIXES) + ")",
    )
    g.add_argument(
        "--jsonl-keys", nargs="+", default=["text"], help="keys to tokenize; one dataset each"
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
    g.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    g.add_argument(
        "--dataset-impl",
        default="mmap",
        choices=["mmap"],
        help="only mmap is written (accepted for gpt-neox compatibility)",
    )
    g.add_argument("--max-shard-tokens", type=int, default=None, help="split output into shards")
    g.add_argument("--overwrite", action="store_true", help="replace existing output datasets")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes (0: in-process)")
    g.add_argument("--log-interval", type=int, default=100, help="documents between log lines")
    g.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    return p.parse_args(argv)


def _exit_on_sigterm(signum, frame) -> None:
    # Unwinds through preprocess(), which deletes this run's temp files on the way out.
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
        report = preprocess(config)
    except (ValueError, OSError) as e:
        # Input and setup errors already say what to fix; a traceback would bury that.
        logger.error("%s: %s", type(e).__name__, e)
        logger.error("nothing was written (existing datasets are untouched)")
        return 1
    logger.info("done\n%s", report.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
