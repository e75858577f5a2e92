"""A save that cannot be made stops with one line, whatever the file system says: read-only,
deleted, full. The check before a save runs on rank 0 and every rank raises its answer."""

import errno
import json
import subprocess
from pathlib import Path

import pytest

from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.io import failed_save
from neox.checkpoint.lock import acquire, release
from neox.checkpoint.manifest import MANIFEST


@pytest.fixture
def save(tmp_path) -> Path:
    """A locked save directory holding a staged, half-written save."""
    save = tmp_path / "ckpt"
    acquire(save)
    staging = save / "global_step6.partial"
    staging.mkdir()
    (staging / "mp_rank_00_model_states.pt").write_bytes(b"0" * 1000)
    yield save
    release(save)


def test_a_file_system_error_during_a_save_is_one_line(save):
    """Issue 33 (8): a save directory made read-only mid-run gave a PermissionError traceback."""
    staging = save / "global_step6.partial"
    error = PermissionError(errno.EACCES, "Permission denied", str(staging / "x.pt"))
    with pytest.raises(CheckpointError) as e:
        failed_save(error, save, staging)
    assert str(e.value).startswith(
        f"saving checkpoint global_step6 to {save} failed: Permission denied ({staging / 'x.pt'})"
        "; the partial save was removed"
    )
    assert "\n" not in str(e.value) and not staging.exists()


def test_a_save_without_room_for_the_last_checkpoints_size_is_refused_before_writing(save):
    from neox.checkpoint.io import save_problem

    (save / "global_step3").mkdir()
    huge = {"global_step3/mp_rank_00_model_states.pt": 10**15}
    (save / "global_step3" / MANIFEST).write_text(json.dumps({"iteration": 3, "files": huge}))
    (save / "latest").write_text("global_step3")
    problem = save_problem(save, save / "global_step6.partial")
    assert problem is not None
    assert problem.startswith(f"saving checkpoint global_step6 to {save} failed: No space left")
    assert "1000000000.0 MB needed); nothing was written" in problem
    assert not (save / "global_step6.partial").exists()


def test_a_save_dir_made_read_only_mid_run_is_refused_before_any_rank_writes(tmp_path):
    """The save directory turns read-only while the run holds it (here: a read-only bind mount
    over it, which root cannot write through either)."""
    from neox.checkpoint.io import save_problem

    save = tmp_path / "ckpt"
    acquire(save)
    try:
        assert save_problem(save, save / "global_step3.partial") is None
        (save / "global_step3.partial").rmdir()
        if subprocess.run(["mount", "--bind", str(save), str(save)]).returncode != 0:
            pytest.skip("cannot bind-mount here (needs root)")
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(save)], check=True)
            problem = save_problem(save, save / "global_step6.partial")
        finally:
            subprocess.run(["umount", str(save)], check=True)
    finally:
        release(save)
    assert problem == (
        f"saving checkpoint global_step6 to {save} failed: Read-only file system "
        f"({save / 'global_step6.partial'}); nothing was written and the checkpoints there are "
        "untouched. Make the directory writable, or point `save` elsewhere, and resume"
    )
