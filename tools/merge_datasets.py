"""Concatenate indexed datasets (.bin/.idx shards) into one, keeping document boundaries.

Example:
    python tools/merge_datasets.py --input data/shards --output-prefix data/pile_text_document
merges every <name>.bin/.idx pair in data/shards (sorted by name). --input also takes
comma-separated prefixes (without extension) to merge in the given order.
"""

from __future__ import annotations

import argparse
import logging
import sys

from neox.data.indexed import merge_datasets

logger = logging.getLogger("merge_datasets")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--input", required=True, help="directory of shards, or comma-separated prefixes"
    )
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output dataset")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        summary = merge_datasets(args.input, args.output_prefix, overwrite=args.overwrite)
    except (ValueError, OSError) as e:
        logger.error("%s: %s", type(e).__name__, e)
        logger.error("nothing was written (existing datasets are untouched)")
        return 1
    logger.info("%s", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
