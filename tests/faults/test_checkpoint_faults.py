"""A checkpoint directory that cannot take another checkpoint (read-only, full), and do_train:
false: a clear error before any rank starts, and the checkpoints already there stay intact."""

import hashlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.train_helpers import make_dataset, run_deepy, run_here, train, write_config

pytestmark = pytest.mark.slow


def mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Iterator[tuple[Path, Path]]:
    """A 3-step run that saved global_step3 into its own small tmpfs; (tmp_path, tmpfs)."""
    tmp = tmp_path_factory.mktemp("ckpt_faults")
    fs = tmp / "fs"
    fs.mkdir()
    r = mount("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(fs))
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        make_dataset(tmp / "data" / "chars")
        train(config(tmp, fs, train_iters=3))
        yield tmp, fs
    finally:
        mount("-o", "remount,rw", str(fs))
        subprocess.run(["umount", str(fs)], check=False)


def config(tmp: Path, fs: Path, **overrides) -> Path:
    ckpt = str(fs / "ckpt")
    return write_config(tmp, "run", num_gpus=1, save=ckpt, load=ckpt, **overrides)


def deepy(cfg: Path) -> subprocess.CompletedProcess:
    return run_deepy("train.py", cfg, check=False)


def resume(cfg: Path) -> subprocess.CompletedProcess:
    """train.py's rank started from here, with deepy.py's resume line first (run_here): for the
    faults the rank meets while it loads or saves (deepy.py's own part: the tests above and
    tests/training/test_lifecycle.py)."""
    return run_here("train.py", cfg, check=False)


def test_read_only_checkpoint_dir_fails_before_launch(trained):
    """Fault: the checkpoint file system is read-only. Promise: exit 2 naming it, before launch."""
    tmp, fs = trained
    before = digest(fs / "ckpt")
    assert mount("-o", "remount,ro", str(fs)).returncode == 0
    try:
        r = deepy(config(tmp, fs, train_iters=6))
    finally:
        mount("-o", "remount,rw", str(fs))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "the checkpoint directory cannot be written (Read-only file system)" in r.stderr
    assert "launching" not in r.stderr and "Traceback" not in r.stderr
    assert digest(fs / "ckpt") == before


def test_full_checkpoint_dir_fails_before_launch(trained):
    """Fault: the checkpoint file system is full. Promise: exit 2 naming it, before launch."""
    tmp, fs = trained
    before = digest(fs / "ckpt")
    filler = fs / "filler"
    # Unbuffered: a buffered file would keep the last partial write and raise ENOSPC again when
    # it is closed (whenever the free space is not a multiple of the chunk).
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    try:
        r = deepy(config(tmp, fs, train_iters=6))
    finally:
        filler.unlink()
    assert r.returncode == 2, r.stderr[-3000:]
    assert "No space left on device" in r.stderr or "MB free" in r.stderr, r.stderr
    assert "launching" not in r.stderr and "Traceback" not in r.stderr
    assert digest(fs / "ckpt") == before


def test_do_train_false_evaluates_and_saves_nothing(trained):
    """Fault (issue 12): do_train: false used to train and save. Promise: it only evaluates."""
    tmp, fs = trained
    before = digest(fs / "ckpt")
    train(config(tmp, fs, train_iters=6, do_train=False))
    assert digest(fs / "ckpt") == before  # no global_step6, `latest` unchanged
    metrics = (tmp / "run" / "logs" / "metrics.jsonl").read_text()
    assert '"split": "valid"' in metrics
    assert '"step": 4' not in metrics  # no training step past the checkpoint's 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 6-step run (no tmpfs needed) that saved global_step3 and global_step6; its tmp path."""
    tmp = tmp_path_factory.mktemp("ckpt_trust")
    make_dataset(tmp / "data" / "chars")
    train(write_config(tmp, "ref", num_gpus=1, train_iters=6))
    return tmp


def copy_run(tmp: Path, name: str, **overrides) -> tuple[Path, Path]:
    """(config, checkpoint dir) of a run resuming from a copy of the reference checkpoints."""
    import shutil

    shutil.copytree(tmp / "ref" / "ckpt", tmp / name / "ckpt")
    return write_config(tmp, name, num_gpus=1, **overrides), tmp / name / "ckpt"


def test_a_planted_payload_is_refused_on_resume(saved):
    """Fault: a pickle payload in state/client_state.pt (manifest updated to match).
    Promise: the run refuses it, naming the file and the opt-in; the payload never runs."""
    from tests.checkpoint.test_trust import plant

    marker = saved / "MARKER"
    cfg, ckpt = copy_run(saved, "planted", train_iters=9)
    plant(ckpt / "global_step6", marker, "state/client_state.pt")
    r = resume(cfg)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert f"{ckpt / 'global_step6' / 'state' / 'client_state.pt'} holds objects" in out
    assert "trust_checkpoint_code: true" in out and "GLOBAL posix.system" in out
    assert not marker.exists()


def test_corrupt_bytes_fall_back_to_the_newest_good_checkpoint(saved):
    """Fault: flipped bytes in the newest checkpoint's tensors, and garbage in `latest`.
    Promise: a warning names the file and the run resumes from the checkpoint before it."""
    from tests.checkpoint.test_trust import flip_byte

    cfg, ckpt = copy_run(saved, "flipped", train_iters=7)
    bad = ckpt / "global_step6" / "state" / "rank_00000.safetensors"
    flip_byte(bad)
    (ckpt / "latest").write_bytes(b"\x00\xff../../global_step6")
    r = resume(cfg)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert f"ignoring {ckpt / 'latest'} is not text" in out
    assert f"skipping checkpoint global_step6: {bad} is corrupt" in out
    assert "resumed from" in out and "at iteration 3" in out
    assert (ckpt / "latest").read_text() == "global_step7"


def test_no_checkpoint_is_saved_during_a_run_of_nonfinite_steps(saved):
    """Fault: lr 1e30 makes every step after the first non-finite. Promise: the steps of the
    streak save nothing (`latest` stays on the last good checkpoint, step 3 of the reference
    run), and the stop names that checkpoint."""
    cfg, ckpt = copy_run(
        saved,
        "nan",
        train_iters=12,
        checkpoint_factor=1,
        no_load_optim=True,
        optimizer={"type": "Adam", "params": {"lr": 1.0e30}},
        max_nonfinite_steps=4,
    )
    (ckpt / "latest").write_text("global_step3")
    import shutil

    shutil.rmtree(ckpt / "global_step6")
    r = resume(cfg)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    saved_steps = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global_step"))
    assert "not saving at iteration 5: the last 1 step(s) had a non-finite" in out, out[-3000:]
    assert (ckpt / "latest").read_text() == "global_step4"  # step 4 itself was finite
    assert saved_steps == ["global_step3", "global_step4"]
    assert f"the last checkpoint saved is {ckpt / 'global_step4'}, before them" in out


def test_a_second_run_on_one_save_directory_is_refused_at_once(saved):
    """Fault: another run holds the save directory. Promise: exit 2 before launch, naming its
    pid and host; no checkpoint is touched."""
    from tests.checkpoint.test_lock import hold

    cfg, ckpt = copy_run(saved, "second", train_iters=9)
    holder = hold(ckpt)
    before = digest(ckpt)
    try:
        r = deepy(cfg)
        after = digest(ckpt)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"is in use by another run (pid {holder.pid} on host" in r.stderr
    assert "launching" not in r.stderr and "Traceback" not in r.stderr
    assert after == before


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Path]:
    """A 1 MiB tmpfs: room for one checkpoint of the tiny model (0.55 MB), not two."""
    fs = tmp_path / "fs"
    fs.mkdir()
    r = mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(fs))
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield fs
    finally:
        subprocess.run(["umount", str(fs)], check=False)


def test_a_save_that_fills_the_disk_says_so_and_leaves_no_partial(saved, small_fs):
    """Fault: the disk fills during the second save, on 2 ranks. Promise: the error says "No
    space left on device" with the directory, on every rank and without a traceback (rank 1
    added a gloo one, issue 33), the partial save is removed, `latest` stays on the first; the
    relaunch is refused before launch for want of room."""
    ckpt = small_fs / "ckpt"
    cfg = write_config(saved, "full", num_gpus=2, save=str(ckpt), load=str(ckpt))
    # Ranks started from here: no agent kills rank 1 before its collective fails.
    r = run_here("train.py", cfg, check=False)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert f"saving checkpoint global_step6 to {ckpt} failed: No space left on device" in out
    assert "basic_ios" not in out.split("No space left on device")[-1]
    assert "Traceback" not in out, out[-3000:]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global")) == ["global_step3"]
    assert (ckpt / "latest").read_text() == "global_step3"
    again = deepy(cfg)
    assert again.returncode == 2 and "MB free, but one checkpoint needs" in again.stderr


def measured_and_estimated(tmp: Path, name: str, step: str) -> tuple[int, int, str]:
    """(bytes of the run's checkpoint `step`, the pre-launch room check's figure, the engine)."""
    from neox.config import derive, load_config
    from neox.plan.engine_choice import engine_for
    from neox.plan.preflight import checkpoint_bytes, preflight

    loaded = load_config([str(tmp / f"{name}.yml")])
    vocab, _ = preflight(loaded, "train.py")
    derived = derive(loaded.config, loaded.config.launcher.num_gpus, vocab)
    files = (tmp / name / "ckpt" / step).rglob("*")
    measured = sum(f.stat().st_size for f in files if f.is_file())
    engine = engine_for(loaded.config, derived).engine
    return measured, checkpoint_bytes(loaded.config, derived), engine


def test_the_room_check_asks_what_each_engine_writes(saved):
    """Issue 33 (5): the room check counted 12 bytes per parameter for fp32 runs, the flat
    engine writes 16 (its fp32 partition beside Adam's moments), so a disk-full relaunch was
    accepted and failed at the same save. Measured on both engines' real checkpoints: the
    figure covers each, within a tenth."""
    measured, estimated, engine = measured_and_estimated(saved, "ref", "global_step6")
    assert engine == "flat"
    assert measured <= estimated <= 1.1 * measured, (measured, estimated)
    train(write_config(saved, "ds", num_gpus=1, train_iters=3, flat_engine=False))
    measured, estimated, engine = measured_and_estimated(saved, "ds", "global_step3")
    assert engine == "deepspeed"
    assert measured <= estimated <= 1.1 * measured, (measured, estimated)


def test_a_stop_during_nonfinite_steps_claims_no_checkpoint(saved):
    """Issue 33 (6): SIGTERM during a run of non-finite steps saves nothing; deepy printed
    `checkpoint saved in <save>/None`, or an older step as this stop's. It now says no
    checkpoint was saved at this stop and names the one to resume from."""
    import os
    import shutil
    import signal

    from tests.training.lifecycle_helpers import BackgroundRun

    cfg, ckpt = copy_run(
        saved,
        "nanstop",
        train_iters=1000,
        checkpoint_factor=1,
        eval_interval=1000,
        no_load_optim=True,
        optimizer={"type": "Adam", "params": {"lr": 1.0e30}},
        max_nonfinite_steps=1000,
    )
    (ckpt / "latest").write_text("global_step3")
    shutil.rmtree(ckpt / "global_step6")
    run = BackgroundRun(cfg, saved / "nanstop.out")
    try:
        run.wait_for("not saving at iteration 5")
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.wait() == 0, run.text()[-3000:]
    finally:
        run.kill_all()
    out = run.text()
    assert "checkpoint saved in" not in out, out[-3000:]
    assert (
        "deepy: stopped by SIGTERM; no checkpoint was saved at this stop (the ranks' output above "
        f"says why); the run can resume from the last checkpoint, {ckpt / 'global_step4'}, "
        "saved before it"
    ) in out, out[-3000:]


def test_a_save_dir_deleted_mid_run_stops_the_run_at_its_next_save(saved):
    """Issue 33 (3): `save` deleted mid-run was re-created without a lock file at the next save,
    and a second run shared it. Now the next save stops every rank with one line, and the
    directory is not re-created."""
    import shutil
    import threading
    import time

    # Resumed at step 6, the next save is at step 200: the folder is gone long before it.
    cfg, ckpt = copy_run(saved, "deleted", train_iters=400, checkpoint_factor=200)
    logs = saved / "deleted" / "logs" / "train-ranks"  # run_here's rank output
    ended = threading.Event()

    def delete_once_resumed() -> None:
        while not ended.is_set():
            if any("resumed from" in f.read_text() for f in logs.glob("0.*")):
                shutil.rmtree(ckpt)
                return
            time.sleep(0.05)

    deleter = threading.Thread(target=delete_once_resumed)
    deleter.start()
    try:
        r = resume(cfg)
    finally:
        ended.set()
        deleter.join()
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert f"train.py: save={str(ckpt)!r} was deleted while this run held it" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not ckpt.exists()
