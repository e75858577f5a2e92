"""What a rank tells its agent about its progress, and what it is told about restarts.

A rank touches its heartbeat file (NEOX_HEARTBEAT, set by its agent when `hang_timeout_s` is
on) after each finished step, evaluation and save; the agent reads the files' modification
times and takes a rank whose file is older than the timeout for hung. A rank that has not
finished its first step has no file yet and is not timed: building, compiling and loading a
checkpoint take as long as they take; nor is one past its last step and save (its file removed),
whose leaving does. NEOX_RESTART ("k/N") marks the k-th of at most N
relaunches deepy.py made after a failure.
"""

import os
import time
from pathlib import Path
from typing import Optional

HEARTBEAT_ENV = "NEOX_HEARTBEAT"
RESTART_ENV = "NEOX_RESTART"

_heartbeat: Optional[str] = os.environ.get(HEARTBEAT_ENV)


def beat() -> None:
    """This rank finished a step (or an evaluation or save): a no-op unless its agent watches."""
    if _heartbeat:
        Path(_heartbeat).touch()


def rest() -> None:
    """This rank's steps and saves are done, only leaving is left: its agent stops timing it."""
    if _heartbeat:
        Path(_heartbeat).unlink(missing_ok=True)


def restart() -> Optional[tuple[int, int]]:
    """(k, N) in the k-th relaunch of at most N, or None in a first launch."""
    value = os.environ.get(RESTART_ENV)
    if not value:
        return None
    done, most = value.split("/")
    return int(done), int(most)


def heartbeat_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}")


def stalest(folder: str, ranks: list[int], timeout_s: float) -> Optional[tuple[int, float]]:
    """(rank, seconds since its last finished step) of the rank idle longest beyond `timeout_s`,
    or None; ranks without a finished step yet are not timed."""
    now = time.time()
    idle = []
    for rank in ranks:
        try:
            idle.append((now - os.stat(heartbeat_path(folder, rank)).st_mtime, rank))
        except FileNotFoundError:
            continue
    if not idle:
        return None
    seconds, rank = max(idle)
    return (rank, seconds) if seconds > timeout_s else None
