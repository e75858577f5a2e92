"""A rank's lifeline to deepy.py: when deepy.py is gone (kill -9), the rank stops as on SIGTERM.

deepy.py starts DeepSpeed's runner in a session of its own, so a SIGKILL of deepy.py reaches
nothing below it: the runner, launch.py and the ranks would train on, orphaned. Each rank
therefore watches the deepy.py process it was launched by (named in its environment, with its
host and start time so a reused pid is not mistaken for it). When it disappears the rank sends
itself SIGTERM: a training rank finishes the step in flight, saves and exits like on a scheduler's
SIGTERM, and the runner and launch.py end once their ranks have. A rank still alive `grace_s`
later (stuck in a collective with a dead peer, say) kills itself.

psutil makes this work wherever it does; ranks on another machine than deepy.py cannot watch it
(they stop with the others, which agree on stopping every step).
"""

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping
from typing import Optional

import psutil

log = logging.getLogger(__name__)

LAUNCHER_ENV = "NEOX_LAUNCHER_PROCESS"
_RUNNER = "deepspeed.launcher.runner"
# A save of a large model takes minutes; a rank that needs longer than this is taken as stuck.
DEFAULT_GRACE_S = 600.0


def launcher_identity() -> str:
    """HOST:PID:START_TIME of this process, for the ranks it launches to watch."""
    me = psutil.Process()
    return f"{socket.gethostname()}:{me.pid}:{me.create_time()!r}"


def watch_launcher(
    environ: Optional[Mapping[str, str]] = None,
    *,
    poll_s: float = 0.5,
    grace_s: float = DEFAULT_GRACE_S,
) -> Optional[threading.Thread]:
    """Start watching the launching deepy.py in a daemon thread; None when there is nothing to
    watch (no deepy.py launched this process, or it runs on another machine)."""
    value = (os.environ if environ is None else environ).get(LAUNCHER_ENV)
    if not value:
        return None
    try:
        host, pid, created = value.rsplit(":", 2)
        pid, created_at = int(pid), float(created)
    except ValueError:
        log.warning("ignoring %s=%r: expected HOST:PID:START_TIME", LAUNCHER_ENV, value)
        return None
    if host != socket.gethostname() or not _launched_here(pid, created_at):
        return None
    thread = threading.Thread(
        target=_watch,
        args=(pid, created_at, poll_s, grace_s),
        name="neox-launcher-lifeline",
        daemon=True,
    )
    thread.start()
    return thread


def _launched_here(pid: int, created_at: float) -> bool:
    """Whether deepy.py ran in this machine's process namespace: it is visible now, or (killed
    while this rank started) DeepSpeed's local runner, its child, is among our ancestors. A
    deepy.py never seen from here (another machine of the same name, another container) is not
    taken for a dead one."""
    if _alive(pid, created_at):
        return True
    try:
        return any(_RUNNER in parent.cmdline() for parent in psutil.Process().parents())
    except psutil.Error:
        return False


def _alive(pid: int, created_at: float) -> bool:
    try:
        proc = psutil.Process(pid)
        # A zombie deepy.py is dead too: its parent (a shell, a test) has not reaped it yet.
        return abs(proc.create_time() - created_at) < 0.05 and proc.status() != "zombie"
    except psutil.AccessDenied:
        return True  # not ours to inspect: not known to be dead
    except psutil.Error:
        return False


def _watch(pid: int, created_at: float, poll_s: float, grace_s: float) -> None:
    while _alive(pid, created_at):
        time.sleep(poll_s)
    log.warning(
        "deepy.py (pid %d) is gone: stopping this rank as on SIGTERM (killed if still running "
        "in %g s)",
        pid,
        grace_s,
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    log.error("still running %g s after deepy.py ended: killing this rank", grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
