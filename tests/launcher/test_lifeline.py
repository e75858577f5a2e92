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


def test_a_launcher_gone_before_the_rank_started_is_seen_through_the_runner():
    # This test process's pid with another start time: a deepy.py that no longer runs. The
    # rank's parent has DeepSpeed's runner module in its command line, as in a local launch.
    host, pid, created = identity_of(os.getpid()).split(":")
    stale = f"{host}:{pid}:{float(created) - 100}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{LAUNCHER_ENV: stale})
    runner = "import subprocess, sys; print(subprocess.run(sys.argv[2:]).returncode)"
    runner_proc = subprocess.Popen(  # starts the rank, and prints how it ended
        [sys.executable, "-c", runner, "deepspeed.launcher.runner"]
        + [sys.executable, "-c", STUCK_RANK, "0.5"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert runner_proc.stdout.readline() == "watching\n"
        assert runner_proc.stdout.readline() == "SIGTERM\n"
        assert runner_proc.stdout.readline() == f"{-signal.SIGKILL}\n"  # the rank's status
        assert runner_proc.wait(timeout=10) == 0
    finally:
        runner_proc.kill()


def test_a_launcher_never_seen_from_here_is_not_taken_for_a_dead_one():
    # The pid of a process on another machine of the same name, or in another container.
    host, pid, created = identity_of(os.getpid()).split(":")
    assert watch_launcher({LAUNCHER_ENV: f"{host}:{pid}:{float(created) - 100}"}) is None


def test_nothing_to_watch_without_a_launcher_or_on_another_host():
    assert watch_launcher({}) is None
    assert watch_launcher({LAUNCHER_ENV: f"other-host.invalid:{os.getpid()}:1.0"}) is None
    assert watch_launcher({LAUNCHER_ENV: "garbage"}) is None
