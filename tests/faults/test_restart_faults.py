"""Automatic restart (`max_restarts`, `hang_timeout_s`) through deepy.py: a rank killed between
two checkpoints, a rank stopped (SIGSTOP) and a rank that dies at start every time, on real CPU
ranks, one node and two nodes over pdsh (a real sshd). That a stop under max_restarts is never
restarted: tests/launcher/test_launchers_mpi_slurm.py (SIGTERM saves, openmpi and slurm)."""

import atexit
import functools
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.launcher.conftest import sshd  # noqa: F401  (the module's sshd fixture)
from tests.launcher.test_deepy_multinode import two_node_training
from tests.process_helpers import child_env
from tests.train_helpers import (
    ROOT,
    deepy_env,
    losses,
    make_dataset,
    records,
    run_train,
    train,
    write_config,
)

pytestmark = pytest.mark.slow

# 12 steps, checkpoints at 4, 8 and 12; ZeRO 0 as on the two pdsh "nodes" (two_node_training).
RUN = dict(
    train_iters=12,
    checkpoint_factor=4,
    eval_interval=1000,
    do_test=False,
    zero_optimization={"stage": 0},
)

# A fault in rank RANK of the first launch, on the caller's PYTHONPATH (which the ranks keep, on
# every node): at its second heartbeat (a finished step or save; hang_timeout_s makes the agent
# watch them) once `LATEST` exists, the rank sends itself SIGNAL. So it dies (or stops) after
# step 5 or 6, while step 8 is still ahead: at a known point, with no race against the run.
FAULT = """
import os, sys
def _arm(rank, signal, latest):
    beat = os.environ.get("NEOX_HEARTBEAT")
    if os.environ.get("RANK") != rank or "NEOX_RESTART" in os.environ or not beat:
        return
    seen = []
    def hook(event, args):
        if event in ("os.utime", "open") and args and str(args[0]) == beat:
            if os.path.exists(latest):
                seen.append(event)
                if len(seen) == 2:
                    os.kill(os.getpid(), signal)
    sys.addaudithook(hook)
_arm({rank!r}, {signal}, {latest!r})
"""


def fault(tmp_path: Path, name: str, sig: int, rank: int = 1) -> str:
    """A PYTHONPATH whose sitecustomize arms FAULT for run `name`'s checkpoint at step 4."""
    folder = tmp_path / "fault"
    folder.mkdir()
    latest = tmp_path / name / "ckpt" / "latest"
    (folder / "sitecustomize.py").write_text(
        FAULT.format(rank=str(rank), signal=int(sig), latest=str(latest))
    )
    return child_env(str(folder))["PYTHONPATH"]


@functools.cache
def reference_losses() -> dict[int, float]:
    """The uninterrupted run's losses, its 2 ranks started from this process; once per test
    process, since every launcher's run must give the same."""
    folder = Path(tempfile.mkdtemp(prefix="neox-restart-reference-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    make_dataset(folder / "data" / "chars")
    train(write_config(folder, "reference", **RUN))
    return losses(folder / "reference" / "logs")


def restart_between_checkpoints(
    tmp_path: Path, keys: dict, sig: int = signal.SIGKILL, **env: str
) -> str:
    """deepy.py with max_restarts: 1; rank 1 sends itself `sig` after step 5 or 6: SIGKILL, it
    dies; SIGSTOP, it is alive but finishes no step (hang_timeout_s: 4 takes it for hung). The
    job ends with exit 0 and every step's loss equal to an uninterrupted run's; returns its
    output."""
    make_dataset(tmp_path / "data" / "chars")
    # The launcher's keys, and RUN's steps and checkpoints.
    hang_timeout_s = 4 if sig == signal.SIGSTOP else 600
    flat = {**keys, **RUN, "max_restarts": 1, "hang_timeout_s": hang_timeout_s}
    cfg = write_config(tmp_path, "restarted", **flat)
    r = run_train(cfg, PYTHONPATH=fault(tmp_path, "restarted", sig), **env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    [line] = [ln for ln in out.splitlines() if "restart 1/1 after" in ln]
    assert line.split("restart 1/1 after: ")[1].startswith("rank 1 on"), line
    if sig == signal.SIGSTOP:  # its peer, waiting in a collective, is killed with it: no error
        assert "hung: no finished step for" in line and "hang_timeout_s=4" in line, line
        assert "Traceback" not in out
    else:
        assert "was killed by SIGKILL" in line, line
    assert line.endswith("it resumes from " + str(tmp_path / "restarted" / "ckpt" / "global_step4"))
    # The relaunch is counted in the metrics of every step it logged.
    steps = [r for r in records(tmp_path / "restarted" / "logs") if r["split"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert [r.get("restarts", 0) for r in steps] == [0] * 4 + [1] * 8
    [last] = [ln for ln in out.splitlines() if "iter 12/12" in ln]
    assert " | restart 1 | " in last, last  # the log line says so too
    assert losses(tmp_path / "restarted" / "logs") == reference_losses()
    return out


def test_a_stopped_rank_is_taken_for_hung_and_restarted(tmp_path):
    """A rank alive but finishing no step (SIGSTOP): its agent kills the ranks, deepy.py
    relaunches them. (A rank killed, every node restarted: the pdsh test below, and openmpi and
    slurm in tests/launcher/test_launchers_mpi_slurm.py.)"""
    restart_between_checkpoints(tmp_path, {}, signal.SIGSTOP)


def test_kill_9_of_a_rank_on_a_pdsh_node_restarts_every_node(sshd, tmp_path):  # noqa: F811
    keys = two_node_training(sshd, tmp_path)
    # One thread per rank on both nodes, as the reference's ranks have: the same sums.
    keys["export_env"] = ["OMP_NUM_THREADS"]
    out = restart_between_checkpoints(
        tmp_path, keys, PDSH_SSH_ARGS_APPEND=sshd.ssh_args, OMP_NUM_THREADS="1"
    )
    # Both nodes' agents were told to end their ranks, then both started again.
    assert out.count("launching 2 rank(s) on localhost, 127.0.0.1") == 2, out[-3000:]


def test_a_rank_that_dies_at_start_every_time_is_restarted_n_times_then_named(tmp_path):
    # Rank 1 kills itself as its interpreter starts (a sitecustomize on the caller's
    # PYTHONPATH, which the ranks keep): every launch fails the same way.
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os, signal\n"
        "if os.environ.get('RANK') == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    make_dataset(tmp_path / "data" / "chars")
    cfg = write_config(tmp_path, "doomed", max_restarts=2, **RUN)
    r = run_train(cfg, PYTHONPATH=child_env(str(inject))["PYTHONPATH"])
    out = r.stdout + r.stderr
    assert r.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert out.count("launching 2 rank(s)") == 3, out[-3000:]
    assert "restart 1/2 after: rank 1 on" in out and "restart 2/2 after: rank 1 on" in out
    assert "it starts over: no checkpoint saved yet" in out
    [last] = [ln for ln in out.splitlines() if "giving up" in ln]
    assert "failed 3 time(s), the limit max_restarts=2 reached" in last, last
    assert "rank 1 on" in last and "was killed by SIGKILL" in last, last
    assert last.endswith("once it is fixed, the same command starts over: no checkpoint saved yet")
    assert "Traceback" not in out


def test_an_error_a_relaunch_would_meet_again_is_not_restarted(tmp_path):
    # A train.py whose rank 1 exits 2, as train.py does on a config, data or checkpoint error.
    script = tmp_path / "train.py"
    script.write_text("import os, sys\nsys.exit(2 if os.environ['RANK'] == '1' else 0)\n")
    make_dataset(tmp_path / "data" / "chars")
    cfg = write_config(tmp_path, "bad", max_restarts=2, **RUN)
    r = subprocess.run(
        [sys.executable, str(ROOT / "deepy.py"), str(script), str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=deepy_env(),
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert out.count("launching 2 rank(s)") == 1 and "restart 1/2" not in out, out[-3000:]
    assert "rank 1 on" in out and "exited with status 2" in out
