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
import sys

from neox.prep.chat import ChatEncoder, ChatOptions, ChatTemplateError
from neox.prep.tool import (
    add_count_args,
    add_output_and_runtime_args,
    config_from_args,
    run_preprocess,
)

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
    add_count_args(g)
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-path", required=True, help="Hugging Face tokenizer directory with a template"
    )
    g.add_argument("--ftfy", action="store_true", help="accepted for gpt-neox compatibility")
    add_output_and_runtime_args(
        p, "<prefix>_<key>_document and <prefix>_<key>_label_document .bin/.idx"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = ChatOptions(
        tokenizer_path=args.tokenizer_path,
        generation_role=args.generation_role,
        only_last=args.only_last,
        no_mask=args.no_mask,
        for_rm=args.for_rm,
        reward_key=args.reward_key,
        binary_reward=args.binary_reward,
    )
    return run_preprocess(
        logger,
        # tokenizer_type is unused: the chat encoder loads --tokenizer-path.
        lambda: config_from_args(args, tokenizer_type="HFTokenizer"),
        lambda config: ChatEncoder(config, options),
        errors=(ChatTemplateError,),
    )


if __name__ == "__main__":
    sys.exit(main())
