"""Checks against the filesystem before launch: data, vocab files, the checkpoint to resume."""

import logging
from pathlib import Path
from typing import Optional

from neox.config.errors import ConfigError
from neox.config.loader import LoadedConfig

log = logging.getLogger(__name__)


def data_prefixes(cfg) -> list[tuple[str, str]]:
    """(config key, dataset prefix) for every dataset the config names."""
    d = cfg.data
    out = [("data_path", d.data_path)] if d.data_path else []
    for split in ("train", "valid", "test"):
        out += [(f"{split}_data_paths", p) for p in getattr(d, f"{split}_data_paths") or []]
    return out


def check_data(loaded: LoadedConfig) -> None:
    """Every dataset prefix has its .bin and .idx; training needs at least one dataset."""
    cfg = loaded.config
    prefixes = data_prefixes(cfg)
    if not prefixes:
        raise ConfigError(
            "no training data: set data_path (one .bin/.idx prefix, split by `split`) or "
            "train_data_paths; make one with tools/prepare_data.py and tools/preprocess_data.py"
        )
    missing = []
    for key, prefix in prefixes:
        absent = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
        if absent:
            missing.append(
                f"{loaded.source_of(key)}: {key}={prefix!r}: {' and '.join(prefix + s for s in absent)} "
                "not found; run tools/preprocess_data.py (it writes <prefix>.bin/.idx) or fix the path"
            )
    if missing:
        raise ConfigError("\n".join(missing))


def check_tokenizer_files(loaded: LoadedConfig) -> None:
    """The vocab and merge files the tokenizer type needs exist."""
    t = loaded.config.tokenizer
    needs = {
        "GPT2BPETokenizer": ("vocab_file", "merge_file"),
        "HFTokenizer": ("vocab_file",),
        "HFGPT2Tokenizer": (),
        "SPMTokenizer": ("vocab_file",),
        "CharLevelTokenizer": (),
        "TiktokenTokenizer": (),
    }[t.tokenizer_type]
    problems = []
    for key in needs:
        value = getattr(t, key)
        if value is None:
            problems.append(f"tokenizer_type={t.tokenizer_type} needs {key}; set it in a config")
        elif not Path(value).is_file():
            problems.append(
                f"{loaded.source_of(key)}: {key}={value!r} does not exist; fix the path"
            )
    if problems:
        raise ConfigError("\n".join(problems))


def tokenizer_vocab_size(loaded: LoadedConfig) -> Optional[int]:
    """The tokenizer's vocabulary size (loads the tokenizer files; no torch)."""
    from neox.tokenizer import build_tokenizer

    t = loaded.config.tokenizer
    return build_tokenizer(t.tokenizer_type, t.vocab_file, t.merge_file).vocab_size
