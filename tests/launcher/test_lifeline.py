"""A rank's lifeline to deepy.py: SIGTERM to itself when deepy.py is gone, SIGKILL if stuck."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from neox.launcher.lifeline import LAUNCHER_ENV, launcher_identity, watch_launcher

ROOT = Path(__file__).resolve().parents[2]

# A rank stand-in that notes SIGTERM and then stays (as one stuck in a collective would).
STUCK_RANK = """
import signal, sys, time
from neox.launcher.lifeline import watch_launcher
signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM", flush=True))
print("watching", flush=True)
watch_launcher(poll_s=0.05, grace_s=float(sys.argv[1]))
time.sleep(60)
"""


def start_rank(launcher: str, grace_s: float) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{LAUNCHER_ENV: launcher})
    rank = subprocess.Popen(
        [sys.executable, "-c", STUCK_RANK, str(grace_s)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rank.stdout.readline() == "watching\n"
    return rank


def identity_of(pid: int) -> str:
    host = launcher_identity().split(":", 1)[0]
    return f"{host}:{pid}:{psutil.Process(pid).create_time()!r}"


def test_rank_is_told_to_stop_then_killed_when_the_launcher_dies():
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank = start_rank(identity_of(launcher.pid), grace_s=1.0)
    try:
        time.sleep(0.3)
        assert rank.poll() is None  # the launcher lives: nothing happens
        launcher.kill()
        launcher.wait()
        start = time.monotonic()
        assert rank.stdout.readline() == "SIGTERM\n"
        assert rank.wait(timeout=10) == -signal.SIGKILL
        assert time.monotonic() - start < 5
    finally:
        launcher.kill()
        rank.kill()


def test_a_reused_pid_is_not_the_launcher():
    # This test process's pid with another start time: a pid the launcher once had.
    host, pid, created = identity_of(os.getpid()).split(":")
    rank = start_rank(f"{host}:{pid}:{float(created) - 100}", grace_s=0.5)
    try:
        assert rank.stdout.readline() == "SIGTERM\n"
        assert rank.wait(timeout=10) == -signal.SIGKILL
    finally:
        rank.kill()


def test_nothing_to_watch_without_a_launcher_or_on_another_host():
    assert watch_launcher({}) is None
    assert watch_launcher({LAUNCHER_ENV: f"other-host.invalid:{os.getpid()}:1.0"}) is None
    assert watch_launcher({LAUNCHER_ENV: "garbage"}) is None
