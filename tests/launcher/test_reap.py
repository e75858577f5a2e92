"""reap: every process of a launch is gone when it returns, including ones that ignore SIGTERM
and ones that appear while it works."""

import os
import subprocess
import sys
import time

from neox.launcher.reap import reap, tagged_pids

# A process that ignores SIGTERM and starts a child like itself every 0.1 s: a launcher still
# forking ranks when the stop comes.
SPAWNER = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[1] == "parent":
    for _ in range(100):
        subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", sys.argv[2]])
        time.sleep(0.1)
time.sleep(60)
"""


def test_reap_ends_a_forking_tree_that_ignores_sigterm():
    launch_id = f"test-reap-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, NEOX_LAUNCH_ID=launch_id)
    parent = subprocess.Popen([sys.executable, "-c", SPAWNER, "parent", SPAWNER], env=env)
    try:
        while len(tagged_pids(launch_id)) < 3:  # the parent and its first children
            time.sleep(0.05)
        assert reap(launch_id, grace_s=0.3) >= 3
        parent.wait(timeout=10)  # reaps the parent's zombie; the children's go to init
        alive = []
        for pid in tagged_pids(launch_id):
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        assert alive == []
    finally:
        for pid in tagged_pids(launch_id):
            os.kill(pid, 9)
