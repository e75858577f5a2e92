"""Rank 0's progress: a tqdm bar on a terminal, log lines above it; plain lines in a file (the
file case is asserted by tests/training/test_lifecycle.py's stop-signal runs)."""

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from types import SimpleNamespace

import pytest

from neox.training.progress import Progress
from tests.train_helpers import ROOT, SHORT_RUN, deepy_env, make_dataset, write_config

# tqdm's bar: "\r 40%|████▌      | 2/5 [00:00<00:00,  4.86step/s, loss=6.2443]"
BAR = re.compile(r"\r\s*(\d+)%\|[^|\r\n]*\| (\d+)/(\d+) \[[^\]]*step/s")


def open_terminal(columns: int) -> tuple[int, int]:
    """A pseudo-terminal (master, slave) that reports `columns` columns (0: no size)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0, columns, 0, 0))
    return master, slave


def read_all(master: int, proc: subprocess.Popen, timeout: float) -> str:
    """Everything written to the terminal until every process holding it has closed it."""
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: no process holds the terminal any more
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None and not select.select([master], [], [], 1)[0]:
            break
    return out.decode(errors="replace")


@pytest.mark.slow
def test_deepy_on_a_terminal_shows_the_bar_with_the_log_lines_above_it(tmp_path):
    make_dataset(tmp_path / "data" / "chars")
    cfg = write_config(tmp_path, "tty", num_gpus=1, **SHORT_RUN)
    master, slave = open_terminal(columns=120)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "deepy.py"), "train.py", str(cfg)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=deepy_env(),
    )
    os.close(slave)
    try:
        out = read_all(master, proc, timeout=300)
        assert proc.wait(timeout=60) == 0, out[-3000:]
    finally:
        proc.kill()
        os.close(master)
    counts = [(int(m[2]), int(m[3])) for m in BAR.finditer(out)]
    assert counts, out[-3000:]
    assert {total for _, total in counts} == {5}
    assert sorted(set(n for n, _ in counts)) == [0, 1, 2, 3, 4, 5]  # drawn at start too
    # The metrics lines are written above the bar, whole, without the log prefix.
    for step in range(1, 6):
        assert re.search(rf"(^|[\r\n])iter {step}/5 \| samples \d+ ", out), step


def test_a_terminal_that_reports_no_size_still_gets_a_bar(monkeypatch):
    master, slave = open_terminal(columns=0)
    run = SimpleNamespace(
        is_logging_rank=True, cfg=SimpleNamespace(training=SimpleNamespace(train_iters=4))
    )
    out = b""
    with open(slave, "w", encoding="utf-8") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        progress = Progress(run, start=1)
        progress.update({"loss": 2.5})
        progress.log("iter 2/4 | loss 2.5000")
        progress.close()
        terminal.flush()
        while select.select([master], [], [], 0.2)[0]:  # before closing: then the rest is lost
            out += os.read(master, 1 << 16)
    os.close(master)
    text = out.decode(errors="replace")
    assert [m[2] for m in BAR.finditer(text)][-1:] == ["2"], repr(text)
    assert "iter 2/4 | loss 2.5000" in text


def test_a_relaunched_runs_bar_says_which_restart_it_is(monkeypatch):
    master, slave = open_terminal(columns=100)
    run = SimpleNamespace(
        is_logging_rank=True, cfg=SimpleNamespace(training=SimpleNamespace(train_iters=4))
    )
    monkeypatch.setenv("NEOX_RESTART", "1/3")  # what deepy.py's max_restarts sets for a relaunch
    out = b""
    with open(slave, "w", encoding="utf-8") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        progress = Progress(run, start=2)
        progress.update({"loss": 2.5})
        progress.close()
        terminal.flush()
        while select.select([master], [], [], 0.2)[0]:
            out += os.read(master, 1 << 16)
    os.close(master)
    text = out.decode(errors="replace")
    assert re.search(r"restart 1/3: +\d+%\|[^|]*\| 3/4", text), repr(text)
