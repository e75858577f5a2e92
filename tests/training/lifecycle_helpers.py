"""Start a training run in the background, wait for its output, find what it left running."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.train_helpers import ROOT, deepy_env

MARK = "NEOX_TEST_RUN_MARK"


def pids_with_env(name: str, value: str) -> list[int]:
    """Live processes (not zombies) whose environment has name=value: how the tests find every
    process of one launch, whoever its parent is."""
    tag = f"\0{name}={value}\0".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = b"\0" + Path(f"/proc/{entry}/environ").read_bytes() + b"\0"
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag in environ and state != "Z":
            found.append(int(entry))
    return found


class BackgroundRun:
    """deepy.py train.py (or `script`) in the background; every process it starts carries a
    unique mark."""

    def __init__(self, config: Path, out: Path, script: str = "train.py", **env: str) -> None:
        self.mark = uuid.uuid4().hex
        self.out = out
        self.script = script
        with open(out, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "deepy.py"), script, str(config)],
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=deepy_env(**{MARK: self.mark}, **env),
            )

    def text(self) -> str:
        return self.out.read_text()

    def wait_for(self, needle: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            assert self.proc.poll() is None, (
                f"exited {self.proc.returncode}:\n{self.text()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"no {needle!r} in:\n{self.text()[-3000:]}"
            time.sleep(0.2)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise

    def kill_9_deepy(self, timeout: float = 60) -> float:
        """kill -9 deepy.py, then wait until no process of the run is left (asserting that);
        returns the seconds that took."""
        os.kill(self.proc.pid, 9)
        killed = time.monotonic()
        assert self.wait() == -9
        while self.pids() and time.monotonic() - killed < timeout:
            time.sleep(0.2)
        assert self.pids() == [], self.text()[-3000:]
        return time.monotonic() - killed

    def pids(self) -> list[int]:
        """Processes alive with this run's mark (zombies excluded), deepy.py included."""
        return pids_with_env(MARK, self.mark)

    def rank_pid(self, rank: int) -> int:
        for pid in self.pids():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if self.script.encode() in cmdline and f"--local_rank={rank}".encode() in cmdline:
                return pid
        raise AssertionError(f"rank {rank} not found")

    def kill_all(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, 9)
            except OSError:
                pass
