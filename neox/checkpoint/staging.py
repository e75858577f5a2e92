"""Write a whole output directory or nothing: build it beside its target, then rename it in."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path


class OutputDirError(ValueError):
    """The output directory cannot be written as asked; the message says what to pass."""


def check_output_dir(out: Path, overwrite: bool, protected: Iterable[Path] = ()) -> None:
    """Refuse a file, a non-empty directory (unless overwrite) or one holding `protected` paths."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output {out} is a file; pass a directory path")
    for path in protected:
        path = Path(path).resolve()
        if path == out or out in path.parents:
            raise OutputDirError(
                f"output {out} would replace the input {path}; pass another output directory"
            )
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputDirError(
            f"output {out} exists and is not empty; pass --overwrite to replace it, or another "
            "output directory"
        )


def current_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it is to set it
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give root and everything under it the modes a plain mkdir/open would have: mkdtemp makes
    0700 and some writers (safetensors) 0600, whatever the user's umask says."""
    mask = current_umask()
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        if path.is_dir():
            path.chmod(0o777 & ~mask)
        else:
            executable = path.stat().st_mode & 0o111
            path.chmod((0o666 | executable) & ~mask)


@contextlib.contextmanager
def staged_directory(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside `out`; on success it replaces `out`, on error
    it is removed and `out` is left as it was."""
    out = Path(out).resolve()
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    apply_umask(tmp)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
