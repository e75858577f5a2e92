"""Checks against the filesystem before launch: data, vocab files, the checkpoint to resume."""

import logging
import os
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
    """Every dataset prefix has a readable .idx header and a .bin of the size it promises."""
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
        elif (problem := dataset_problem(prefix)) is not None:
            missing.append(f"{loaded.source_of(key)}: {key}={prefix!r}: {problem}")
    if missing:
        raise ConfigError("\n".join(missing))


def dataset_problem(prefix: str) -> Optional[str]:
    """What is wrong with a .bin/.idx pair, from its header and file sizes only (no data read)."""
    from neox.data.indexed import IndexedDataset, IndexedDatasetError

    try:
        IndexedDataset(prefix).close()
    except (IndexedDatasetError, OSError) as e:
        return str(e)
    return None


def check_script(script: str) -> None:
    """The per-rank entry script exists (DeepSpeed's runner would only fail on the ranks)."""
    if not Path(script).is_file():
        raise ConfigError(
            f"entry script {script!r} does not exist; use train.py (or another script of this "
            "checkout) and run deepy.py from the repository root"
        )


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


# What each tokenizer_type reads, for the message when a file is of the wrong kind.
TOKENIZER_FILES = {
    "GPT2BPETokenizer": "vocab_file = GPT-2 vocab.json and merge_file = merges.txt",
    "HFTokenizer": "vocab_file = a Hugging Face tokenizers JSON (tokenizer.json)",
    "SPMTokenizer": "vocab_file = a SentencePiece .model file",
}


def tokenizer_vocab_size(loaded: LoadedConfig) -> Optional[int]:
    """The tokenizer's vocabulary size (loads the tokenizer files; no torch)."""
    from neox.tokenizer import build_tokenizer

    t = loaded.config.tokenizer
    try:
        return build_tokenizer(t.tokenizer_type, t.vocab_file, t.merge_file).vocab_size
    except Exception as e:  # each tokenizer library raises its own types for a foreign file
        files = ", ".join(
            f"{k}={getattr(t, k)!r} ({loaded.source_of(k)})"
            for k in ("vocab_file", "merge_file")
            if getattr(t, k)
        )
        wants = TOKENIZER_FILES.get(t.tokenizer_type, "no files")
        raise ConfigError(
            f"tokenizer_type={t.tokenizer_type} cannot read {files or 'its files'}: "
            f"{type(e).__name__}: {str(e)[:200]}; {t.tokenizer_type} needs {wants}; fix "
            "tokenizer_type or the file"
        ) from None


def has_checkpoint(directory: Optional[str]) -> bool:
    """A DeepSpeed checkpoint directory has a `latest` tag file."""
    return directory is not None and (Path(directory) / "latest").is_file()


def describe_resume(loaded: LoadedConfig) -> str:
    c = loaded.config.checkpoint
    if c.load is None:
        return "no `load` directory: training starts from scratch"
    if has_checkpoint(c.load):
        tag = (Path(c.load) / "latest").read_text().strip()
        return f"resuming from {c.load} (checkpoint {tag})"
    return f"load={c.load} holds no checkpoint yet: training starts from scratch"


# Entry scripts that read training data.
NEEDS_DATA = {"train.py"}


def preflight(loaded: LoadedConfig, script: str) -> tuple[Optional[int], list[str]]:
    """Every check that needs files: (tokenizer vocabulary size or None, problems found).

    A missing entry script raises at once; the other problems are returned, since a dry run
    may plan for another machine where the files exist.
    """
    check_script(script)
    problems = []
    vocab_size = None
    try:
        check_tokenizer_files(loaded)
        vocab_size = tokenizer_vocab_size(loaded)
    except ConfigError as e:
        problems.append(str(e))
    if Path(script).name in NEEDS_DATA:
        try:
            check_data(loaded)
        except ConfigError as e:
            problems.append(str(e))
    return vocab_size, problems


def git_hash() -> Optional[str]:
    """The commit of the neox checkout this code runs from (None outside git)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def checkpoint_bytes(cfg, derived) -> int:
    """A lower bound of one checkpoint's size: the weights in their training precision."""
    from neox.estimate import count_parameters

    params = count_parameters(cfg.model, derived.padded_vocab_size or 0)
    return params * (2 if derived.precision in ("fp16", "bf16") else 4)


def check_save_dir(loaded: LoadedConfig, derived, create: bool) -> None:
    """The `save` directory can be written and has room for at least one checkpoint.

    Args:
        create: make the directory and write a probe file (a real launch); otherwise only look
            at the nearest existing ancestor (a dry run creates nothing).
    """
    import shutil

    save = loaded.config.checkpoint.save
    if save is None:
        return
    where = f"{loaded.source_of('save')}: save={save!r}"
    path = Path(save)
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".neox_write_probe_{os.getpid()}"
            try:
                probe.write_bytes(b"0" * 4096)
            finally:
                probe.unlink(missing_ok=True)
        existing = next(p for p in (path, *path.parents) if p.exists())
        free = shutil.disk_usage(existing).free
    except OSError as e:
        raise ConfigError(
            f"{where}: the checkpoint directory cannot be written ({e.strerror}); make it "
            "writable or point `save` elsewhere"
        ) from None
    need = checkpoint_bytes(loaded.config, derived)
    if free < need:
        raise ConfigError(
            f"{where}: {free / 1e6:.1f} MB free, but one checkpoint needs at least "
            f"{need / 1e6:.1f} MB (the weights alone); free space or point `save` elsewhere"
        )
