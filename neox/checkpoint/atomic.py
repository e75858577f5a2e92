"""Durable file operations for checkpoints: fsync, write-by-rename, and the test kill points.

A save is made durable in this order: every rank's shards written (DeepSpeed) into a staging
directory, a barrier, the files and the directory fsynced, a manifest written, the directory
renamed into place, then `latest` replaced by rename. A crash at any point leaves `latest`
naming a complete checkpoint.
"""

import os
import signal
from pathlib import Path

# NEOX_SAVE_KILL_AT=point[@rank][:iteration]: the rank (default 0) kills itself with SIGKILL when
# a save (of that iteration, default any) reaches the point. Tests use it to show that a crash at
# any moment of a save is harmless.
KILL_ENV = "NEOX_SAVE_KILL_AT"
KILL_POINTS = ("shards", "manifest", "renamed", "latest")


def kill_point(name: str, rank: int, iteration: int) -> None:
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    spec, _, step = spec.partition(":")
    point, _, at = spec.partition("@")
    if point == name and rank == int(at or 0) and (not step or int(step) == iteration):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entry list holds renames)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        fsync_path(path)
    fsync_path(root)


def write_atomic(path: Path, text: str) -> None:
    """Replace path's contents so a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
