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


# DeepSpeed's launch.py, when its 1 s poll reaps a killed rank before deepy's poll sees it: rank 0
# is SIGKILLed and reaped here at once, rank 1 then fails on the closed connection (exit 1), and
# the launcher exits with rank 0's status as launch.py does (sys.exit(-9)). It starts on SIGUSR1,
# once the test's watch knows both ranks.
RANK = "import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: sys.exit(1)); time.sleep(60)"
RACING_LAUNCH = f"""
import os, signal, sys, time
signal.signal(signal.SIGUSR1, lambda *a: None)
pids = []
for r in (0, 1):
    pid = os.fork()
    if pid == 0:
        os.execve(sys.executable, [sys.executable, "-c", {RANK!r}], dict(os.environ, RANK=str(r)))
    pids.append(pid)
signal.pause()
os.kill(pids[0], signal.SIGKILL)
os.waitpid(pids[0], 0)
time.sleep(0.3)
os.kill(pids[1], signal.SIGUSR1)
time.sleep(0.5)
os.waitpid(pids[1], 0)
sys.exit(-9)
"""
# DeepSpeed's runner: launch.py's parent, exiting with its status.
RUNNER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def test_a_rank_reaped_by_launch_py_before_deepy_saw_it_is_still_named_first(caplog):
    from neox.launcher import run

    runner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            RUNNER,
            sys.executable,
            "-c",
            RACING_LAUNCH,
            "deepspeed.launcher.launch",
        ]
    )
    try:
        watch = RankWatch(runner.pid, world_size=2)
        _wait_for(lambda: watch.poll() is None and len(watch.ranks) == 2)
        rank0 = next(pid for pid, rank in watch.ranks.items() if rank == 0)
        launch = psutil.Process(rank0).parent()
        launch.send_signal(signal.SIGUSR1)
        with caplog.at_level("ERROR", logger="neox.launcher.run"):
            code = run._wait(runner, None, watch, grace_s=5)
        assert code == 128 + signal.SIGKILL
        text = caplog.text
        assert f"rank 0 on {watch.host} (pid {rank0}) was killed by SIGKILL" in text, text
        assert "rank 1 on" not in text
    finally:
        runner.kill()
        runner.wait()
