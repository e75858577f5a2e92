"""Process state read from /proc, for tests that check what a run left running, and the
environment of the child processes tests start."""

import os
import time
from collections.abc import Callable
from pathlib import Path

from neox.launcher.plan import neox_pythonpath


def child_env(*first: str, **extra: str) -> dict[str, str]:
    """This environment for a child process, `extra` variables set on top: PYTHONPATH as the
    launcher gives its ranks (this checkout, then the caller's own, where an image such as the
    device's keeps its packages), with the `first` folders before the caller's."""
    existing = os.pathsep.join([*first, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, **extra, PYTHONPATH=neox_pythonpath(existing))


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
