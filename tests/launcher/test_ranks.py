"""RankWatch: names the rank that died, also when it was first seen between fork and exec."""

import os
import signal
import subprocess
import sys
import time

import psutil

from neox.launcher.ranks import RankWatch

# Stands in for DeepSpeed's launch.py (its command line names the module): forks one child that
# waits 1 s before exec'ing a rank with RANK=3, then sleeps without reaping it.
LAUNCH = """
import os, sys, time
pid = os.fork()
if pid == 0:
    time.sleep(1.0)
    env = dict(os.environ, RANK="3")
    os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"], env)
time.sleep(60)
"""


def _wait_for(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_rank_seen_before_exec_is_learnt_after_it_and_named_when_killed():
    launch = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "deepspeed.launcher.launch"], env=dict(os.environ)
    )
    try:
        _wait_for(lambda: psutil.Process(launch.pid).children())
        child = psutil.Process(launch.pid).children()[0]
        watch = RankWatch(os.getpid(), world_size=1)
        assert watch.poll() is None
        assert watch.ranks == {}, "a child that has not exec'd yet is not a rank"

        _wait_for(lambda: "deepspeed.launcher.launch" not in child.cmdline())
        _wait_for(lambda: watch.poll() is None and watch.ranks)
        assert watch.ranks == {child.pid: 3}

        os.kill(child.pid, signal.SIGKILL)
        _wait_for(lambda: watch.poll() is not None)
        text = watch.first_failure.describe()
        assert text.startswith(f"rank 3 on {watch.host} (pid {child.pid})") and "SIGKILL" in text
    finally:
        launch.kill()
        launch.wait()
