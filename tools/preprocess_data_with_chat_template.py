"""Tokenize chat conversations with a tokenizer's own chat template, writing labels that train on
the assistant turns only (gpt-neox's preprocess_data_with_chat_template.py flags).

Example:
    python tools/preprocess_data_with_chat_template.py --input data/chat.jsonl \\
        --output-prefix data/chat --tokenizer-path hf/my-model --jsonl-keys messages --workers 4
writes data/chat_messages_document.bin/.idx (tokens) and data/chat_messages_label_document.bin/.idx
(the token id where trained, -100 elsewhere); train with
    train_data_paths: [data/chat_messages_document]
    train_label_data_paths: [data/chat_messages_label_document]
Each jsonl line holds, under each key, a list of {"role": ..., "content": ...} turns.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from neox.prep.chat import ChatEncoder, ChatOptions, ChatTemplateError
from neox.prep.preprocess import PreprocessConfig, preprocess

logger = logging.getLogger("preprocess_data_with_chat_template")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="comma-separated jsonl files, directories, globs")
    g.add_argument(
        "--jsonl-keys",
        nargs="+",
        default=["conversation"],
        help="keys holding conversations (e.g. messages, or chosen rejected); one dataset each",
    )
    g.add_argument("--no-mask", action="store_true", help="train on every token (no labels)")
    g.add_argument(
        "--for-rm", action="store_true", help="reward-model data: only a final EOS is labelled"
    )
    g.add_argument(
        "--generation-role", default="assistant", help="the role whose turns are trained"
    )
    g.add_argument(
        "--only-last", action="store_true", help="train on the last turn only (mask the rest)"
    )
    g.add_argument("--reward-key", default=None, help="also write this field as a reward dataset")
    g.add_argument("--binary-reward", action="store_true", help="read the reward as a boolean")
    g.add_argument(
        "--num-docs", type=int, default=None, help="expected documents, for the progress bar"
    )
    g.add_argument("--strict", action="store_true", help="stop at the first bad document")
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-path", required=True, help="Hugging Face tokenizer directory with a template"
    )
    g.add_argument("--ftfy", action="store_true", help="accepted for gpt-neox compatibility")
    g = p.add_argument_group("output data")
    g.add_argument(
        "--output-prefix",
        required=True,
        help="writes <prefix>_<key>_document and <prefix>_<key>_label_document .bin/.idx",
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
    # Unwinds through preprocess(), which deletes this run's temp files on the way out.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = PreprocessConfig(
        inputs=args.input,
        output_prefix=args.output_prefix,
        tokenizer_type="HFTokenizer",  # unused: the chat encoder loads --tokenizer-path
        jsonl_keys=tuple(args.jsonl_keys),
        workers=args.workers,
        strict=args.strict,
        log_interval=args.log_interval,
        num_docs=args.num_docs,
        max_shard_tokens=args.max_shard_tokens,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    options = ChatOptions(
        tokenizer_path=args.tokenizer_path,
        generation_role=args.generation_role,
        only_last=args.only_last,
        no_mask=args.no_mask,
        for_rm=args.for_rm,
        reward_key=args.reward_key,
        binary_reward=args.binary_reward,
    )
    try:
        report = preprocess(config, ChatEncoder(config, options))
    except (ValueError, OSError, ChatTemplateError) as e:
        # Input and setup errors already say what to fix; a traceback would bury that.
        logger.error("%s: %s", type(e).__name__, e)
        logger.error("nothing was written (existing datasets are untouched)")
        return 1
    logger.info("done\n%s", report.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
