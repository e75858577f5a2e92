"""One run per save directory: the lock names its holder, dies with it, and the next holder
clears what a dead run left."""

import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neox.checkpoint.lock import (
    LOCK_FILE,
    SaveDirLocked,
    acquire,
    lock_problem,
    reclaimable_bytes,
    release,
)
from tests.train_helpers import ROOT


def hold(save: Path) -> subprocess.Popen:
    """Another process that takes the lock and keeps it until killed."""
    code = (
        "import sys, time\n"
        "from neox.checkpoint.lock import acquire\n"
        f"acquire({str(save)!r})\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_held_lock_is_refused_naming_the_holder_then_taken_over(tmp_path, caplog):
    save = tmp_path / "ckpt"
    holder = hold(save)
    try:
        problem = lock_problem(save)
        assert f"is in use by another run (pid {holder.pid} on host {socket.gethostname()}" in (
            problem or ""
        )
        with pytest.raises(SaveDirLocked, match=f"pid {holder.pid}"):
            acquire(save)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The kernel dropped the dead holder's lock; its record and partial save are left.
    partial = save / "global_step9.partial"
    partial.mkdir()
    (partial / "shard.pt").write_bytes(b"0" * 1000)
    assert lock_problem(save) is None and reclaimable_bytes(save) == 1000
    with caplog.at_level(logging.WARNING):
        acquire(save)
    try:
        assert f"pid {holder.pid}" in caplog.text and "did not end cleanly" in caplog.text
        assert not partial.exists()
        assert f'"pid": {__import__("os").getpid()}' in (save / LOCK_FILE).read_text()
    finally:
        release(save)
    assert (save / LOCK_FILE).read_text() == ""  # a clean end leaves no record


def test_a_clean_exit_leaves_no_record(tmp_path):
    save = tmp_path / "ckpt"
    code = f"from neox.checkpoint.lock import acquire\nacquire({str(save)!r})\n"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    assert (save / LOCK_FILE).read_text() == ""
    start = time.monotonic()
    acquire(save)
    release(save)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("how", ["deleted", "replaced", "lock_file_deleted"])
def test_a_save_dir_deleted_or_replaced_under_the_run_stops_its_next_save(tmp_path, how):
    """Issue 33 (3): `save` deleted mid-run was re-created without a lock file; a second run was
    accepted and both wrote into it. The lock belongs to the directory: the check before each
    save finds it gone, and nothing is re-created."""
    import shutil

    from neox.checkpoint.errors import CheckpointError
    from neox.checkpoint.io import save_problem

    save = tmp_path / "ckpt"
    acquire(save)
    try:
        if how == "deleted":
            shutil.rmtree(save)
        elif how == "replaced":
            save.rename(tmp_path / "moved")
            save.mkdir()
        else:
            (save / LOCK_FILE).unlink()
        why = {"deleted": "was deleted", "replaced": "was replaced", "lock_file_deleted": "lost"}
        with pytest.raises(CheckpointError, match=f"{why[how]}.* while this run held it"):
            acquire(save)
        problem = save_problem(save, save / "global_step4.partial")
        assert problem is not None and "while this run held it" in problem
        assert "\n" not in problem
        assert save.exists() == (how != "deleted")  # never re-created
        assert not (save / "global_step4.partial").exists()
    finally:
        release(save)
