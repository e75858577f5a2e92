"""One run at a time per save directory: rank 0 holds an exclusive lock on `save/.neox.lock`
for the life of the run. Torch-free, so deepy.py checks it before launching anything.

Two runs saving to one directory overwrite each other's step directories, move `latest`
backwards and mix their metrics. The lock is fcntl.flock, released by the kernel whenever the
holder exits (a crash or kill -9 included); the file records host, pid and start time so the
refusal names the run that holds it. A record left by a holder that died says that run did
not end cleanly: the next holder warns, and removes the partial saves it left.

The lock belongs to the directory, not to its name: the holder records the directory's and the
lock file's identities (device, inode) and checks them again before each save. A save
directory deleted or replaced while the run holds it (a second run could then lock the new
one) stops the run instead of re-creating it and sharing it.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Optional

from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.find import STAGING_SUFFIX, TAG_PREFIX

log = logging.getLogger(__name__)

LOCK_FILE = ".neox.lock"
# Open lock files of this process, by resolved save directory: a second acquire checks that the
# directory is still the one locked.
_held: dict[Path, int] = {}
# The (device, inode) of each held directory when its lock was taken.
_held_dirs: dict[Path, tuple[int, int]] = {}


class SaveDirLocked(CheckpointError):
    """Another run holds the save directory."""


class SaveDirLost(CheckpointError):
    """The save directory this run locked was deleted or replaced."""


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def lost_problem(save_dir: Path) -> Optional[str]:
    """Why the save directory this process locked is no longer the one it holds, or None."""
    key = Path(save_dir).resolve()
    fd = _held[key]
    why = None
    try:
        if _identity(os.stat(save_dir)) != _held_dirs[key]:
            why = "was replaced by another directory"
    except FileNotFoundError:
        why = "was deleted"
    if why is None:
        try:
            lock_file = _identity(os.stat(Path(save_dir) / LOCK_FILE))
        except FileNotFoundError:
            lock_file = None
        if lock_file != _identity(os.fstat(fd)):
            why = f"lost its lock file {LOCK_FILE} (it was deleted or replaced)"
    if why is None:
        return None
    return (
        f"save={str(save_dir)!r} {why} while this run held it: another run may be writing there "
        "now, so this run stops rather than share it; point `save` at a directory of its own "
        "and resume from the last checkpoint you still have"
    )


def _holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except ValueError:
        return {"garbage": raw[:80]}
    return holder if isinstance(holder, dict) else {}


def describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"


def _try_lock(save_dir: Path) -> tuple[Optional[int], dict]:
    """(open locked fd, the record found in the file) or (None, the holder's record)."""
    fd = os.open(save_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        return None, holder
    return fd, _holder(fd)


def refusal(save_dir: Path, holder: dict) -> str:
    return (
        f"save={str(save_dir)!r} is in use by another run ({describe(holder)}): two runs on one "
        "save directory overwrite each other's checkpoints; wait for it to end, stop it, or "
        "point `save` elsewhere"
    )


def lock_problem(save_dir: Path) -> Optional[str]:
    """Why a run cannot take the lock now (another run holds it), or None; holds nothing."""
    save_dir = Path(save_dir)
    if not (save_dir / LOCK_FILE).is_file() or save_dir.resolve() in _held:
        return None
    try:
        fd, holder = _try_lock(save_dir)
    except OSError:
        return None  # an unwritable directory is reported by the space and write checks
    if fd is None:
        return refusal(save_dir, holder)
    os.close(fd)  # closing drops the lock
    return None


def acquire(save_dir: Path) -> None:
    """Lock save_dir for this process until it exits; SaveDirLocked when another run holds it.

    A record of a holder that did not release cleanly is reported, and its partial saves
    (`global_stepN.partial`, `global_stepN.old`) are removed: no other run can be writing them.
    """
    save_dir = Path(save_dir)
    key = save_dir.resolve()
    if key in _held:
        if problem := lost_problem(save_dir):
            raise SaveDirLost(problem)
        return
    save_dir.mkdir(parents=True, exist_ok=True)
    fd, holder = _try_lock(save_dir)
    if fd is None:
        raise SaveDirLocked(refusal(save_dir, holder))
    if holder:
        log.warning(
            "taking over the lock of %s: that run (%s) did not end cleanly",
            save_dir / LOCK_FILE,
            describe(holder),
        )
    for stale in stale_saves(save_dir):
        log.warning("removing %s, left by a save that did not finish", stale)
        shutil.rmtree(stale, ignore_errors=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    _held[key] = fd
    _held_dirs[key] = _identity(os.stat(save_dir))
    atexit.register(release, save_dir)


def release(save_dir: Path) -> None:
    """Clear the record (this run ended cleanly) and drop the lock."""
    _held_dirs.pop(Path(save_dir).resolve(), None)
    fd = _held.pop(Path(save_dir).resolve(), None)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def stale_saves(save_dir: Path) -> list[Path]:
    """Partial and replaced step directories a save left behind when it was interrupted."""
    return sorted(
        p
        for p in Path(save_dir).glob(f"{TAG_PREFIX}*")
        if p.is_dir() and p.name.endswith((STAGING_SUFFIX, ".old"))
    )


def reclaimable_bytes(save_dir: Path) -> int:
    """What removing the stale saves frees: the next run removes them when it takes the lock."""
    if lock_problem(save_dir) is not None:
        return 0
    return sum(f.stat().st_size for p in stale_saves(save_dir) for f in p.rglob("*") if f.is_file())
