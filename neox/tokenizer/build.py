"""Build a tokenizer from gpt-neox's `tokenizer_type`, `vocab_file` and `merge_file` keys."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import get_args

from neox.config.data import TokenizerConfig, TokenizerType
from neox.tokenizer.base import Tokenizer, require_file

logger = logging.getLogger(__name__)

TOKENIZER_TYPES: tuple[str, ...] = get_args(TokenizerType)


def build_tokenizer(
    tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None
) -> Tokenizer:
    """Build the tokenizer named by `tokenizer_type` (gpt-neox names, any letter case)."""
    by_lower = {name.lower(): name for name in TOKENIZER_TYPES}
    kind = by_lower.get(str(tokenizer_type).lower())
    if kind is None:
        raise ValueError(
            f"unknown tokenizer_type={tokenizer_type!r}; use one of: {', '.join(TOKENIZER_TYPES)}"
        )
    logger.debug("building %s tokenizer", kind)  # deepy.py and every rank build it: no news
    if kind == "GPT2BPETokenizer":
        from neox.tokenizer.gpt2 import GPT2BPETokenizer

        require_file(vocab_file, "vocab_file", kind)
        require_file(merge_file, "merge_file", kind)
        return GPT2BPETokenizer(vocab_file, merge_file)
    if kind == "HFTokenizer":
        from neox.tokenizer.hf import HFTokenizer

        return HFTokenizer(require_file(vocab_file, "vocab_file", kind))
    if kind == "HFGPT2Tokenizer":
        from neox.tokenizer.hf import HFGPT2Tokenizer

        return HFGPT2Tokenizer(vocab_file, merge_file)
    if kind == "SPMTokenizer":
        from neox.tokenizer.spm import SPMTokenizer

        return SPMTokenizer(require_file(vocab_file, "vocab_file", kind))
    if kind == "CharLevelTokenizer":
        from neox.tokenizer.char import CharLevelTokenizer

        return CharLevelTokenizer()
    from neox.tokenizer.named_tiktoken import TiktokenTokenizer

    return TiktokenTokenizer(vocab_file)


def build_run_tokenizer(t: TokenizerConfig) -> Tokenizer:
    """The run's tokenizer; a missing vocabulary file is a ValueError naming the key to fix."""
    for key in ("vocab_file", "merge_file"):
        path = getattr(t, key)
        if path and t.tokenizer_type != "HFGPT2Tokenizer" and not Path(path).is_file():
            raise ValueError(
                f"the checkpoint's {key}={path!r} is not a file here ({Path.cwd()}); run from "
                "the directory training ran in, or pass --config_file with that key fixed"
            )
    return build_tokenizer(t.tokenizer_type, t.vocab_file, t.merge_file)
