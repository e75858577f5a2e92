"""What the three preprocessing tools share: their gpt-neox flags and how they run.

tools/preprocess_data.py, preprocess_data_with_mask.py and preprocess_data_with_chat_template.py
differ only in their input options and in the encoder they hand to `preprocess`.
"""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable
from typing import Any, Optional

from neox.prep.preprocess import PreprocessConfig, PreprocessReport, preprocess
from neox.prep.readers import SUPPORTED_SUFFIXES
from neox.tokenizer import TOKENIZER_TYPES


def add_input_group(p: argparse.ArgumentParser, keys_help: str) -> argparse._ArgumentGroup:
    """The "input data" group of the text tools: --input (any reader's suffix) and --jsonl-keys."""
    g = p.add_argument_group("input data")
    g.add_argument(
        "--input",
        required=True,
        help="comma-separated files, directories or globs (" + ", ".join(SUPPORTED_SUFFIXES) + ")",
    )
    g.add_argument("--jsonl-keys", nargs="+", default=["text"], help=keys_help)
    return g


def add_count_args(g: argparse._ArgumentGroup) -> None:
    """--num-docs and --strict (input group)."""
    g.add_argument(
        "--num-docs", type=int, default=None, help="expected documents, for the progress bar"
    )
    g.add_argument("--strict", action="store_true", help="stop at the first bad document")


def add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    """The tokenizer group of preprocess_data.py: --tokenizer-type, its files, eod and ftfy."""
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument(
        "--append-eod", action="store_true", help="append the eod token to each document"
    )
    g.add_argument("--ftfy", action="store_true", help="fix text with ftfy before tokenizing")


def tokenizer_fields(args: argparse.Namespace) -> dict[str, Any]:
    """PreprocessConfig's tokenizer fields from add_tokenizer_args' flags."""
    return dict(
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        append_eod=args.append_eod,
        ftfy=args.ftfy,
    )


def add_output_and_runtime_args(p: argparse.ArgumentParser, writes: str) -> None:
    """The output data and runtime groups; `writes` says which datasets the tool writes."""
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help=f"writes {writes}")
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


def config_from_args(args: argparse.Namespace, **fields: Any) -> PreprocessConfig:
    """The PreprocessConfig of the shared flags; `fields` sets the tool's own (tokenizer...)."""
    return PreprocessConfig(
        inputs=args.input,
        output_prefix=args.output_prefix,
        jsonl_keys=tuple(args.jsonl_keys),
        workers=args.workers,
        strict=args.strict,
        log_interval=args.log_interval,
        num_docs=args.num_docs,
        max_shard_tokens=args.max_shard_tokens,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        **fields,
    )


def _exit_on_sigterm(signum, frame) -> None:
    # Unwinds through preprocess(), which deletes this run's temp files on the way out.
    raise SystemExit(128 + signum)


def _ignore_stop_signals() -> None:
    # The datasets are in place: the run has succeeded, whatever stop signal comes now (during
    # the report, or at exit, where Python restores the default handlers: SIG_IGN it keeps).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_preprocess(
    logger: logging.Logger,
    config: Callable[[], PreprocessConfig],
    encoder: Optional[Callable[[PreprocessConfig], Any]] = None,
    errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Run one tool: exit status 0, or 1 with the error in one line (input and setup errors
    already say what to fix; a traceback would bury that). Nothing is written on an error.
    SIGTERM stops the run with 143, SIGINT with 130, until the datasets are in place; from then
    on the process ignores both (it is exiting with 0)."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        cfg = config()
        report: PreprocessReport = preprocess(
            cfg, encoder(cfg) if encoder else None, finished=_ignore_stop_signals
        )
    except (ValueError, OSError, *errors) as e:
        logger.error("%s: %s", type(e).__name__, e)
        logger.error("nothing was written (existing datasets are untouched)")
        return 1
    except KeyboardInterrupt:  # preprocess() removed its temp files on the way out
        logger.error("interrupted: nothing was written (existing datasets are untouched)")
        return 130
    logger.info("done\n%s", report.format())
    return 0
