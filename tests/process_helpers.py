"""Process state read from /proc, for tests that check what a run left running."""

import time
from collections.abc import Callable
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not: it has exited, unreaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until_none(pids: Callable[[], list[int]], timeout: float = 30) -> list[int]:
    """Poll `pids` until it lists none, for at most `timeout` seconds; what it listed last.
    (Processes killed a moment ago may take a while to exit on a loaded machine.)"""
    deadline = time.monotonic() + timeout
    while (found := pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found
