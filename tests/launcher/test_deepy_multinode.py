"""deepy.py with a hostfile and `launcher: pdsh` (an agent per node over ssh): two "nodes" of this
machine over a real sshd."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.port_helpers import free_port
from tests.process_helpers import child_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_deepy_launches_over_pdsh_on_two_nodes(sshd, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two names for this machine\nlocalhost slots=1\n\n127.0.0.1 slots=2\n")
    cfg = tmp_path / "multinode.yml"
    cfg.write_text(
        "\n".join(
            f"{k}: {json.dumps(v)}"
            for k, v in {
                "hostfile": str(hostfile),
                "launcher": "pdsh",
                "master_addr": "127.0.0.1",
                "master_port": free_port(),
                "ssh_port": sshd.port,
                "no_ssh_check": True,
                "tokenizer_type": "CharLevelTokenizer",
                "hidden_size": 48,
                "log_dir": str(tmp_path),
            }.items()
        )
    )
    env = child_env(PDSH_SSH_ARGS_APPEND=sshd.ssh_args)
    env.pop("DS_ACCELERATOR", None)  # the ranks must learn it from the environment deepy exports
    r = subprocess.run(
        [sys.executable, "deepy.py", "tests/deepy_probe_helpers.py", str(cfg)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = {}
    for path in tmp_path.glob("rank*.json"):
        result = json.loads(path.read_text())
        ranks[result["rank"]] = result
    assert sorted(ranks) == [0, 1, 2]
    assert [ranks[i]["node_rank"] for i in range(3)] == [0, 1, 1]
    for result in ranks.values():
        assert result["world_size"] == 3
        assert result["sum"] == 1.0 + 2.0 + 3.0
        assert result["hidden_size"] == 48
        assert result["ds_accelerator"] == "cpu"


def two_node_training(sshd, tmp_path) -> dict:
    """Config keys of a tiny training run on two "nodes" of this machine over pdsh."""
    from tests.train_helpers import make_dataset
    from tests.training.lifecycle_helpers import MARK

    make_dataset(tmp_path / "data" / "chars")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    return dict(
        hostfile=str(hostfile),
        launcher="pdsh",
        master_addr="127.0.0.1",
        ssh_port=sshd.port,
        no_ssh_check=True,
        num_gpus=1,
        export_env=[MARK],  # so that the ranks on both nodes carry the test's mark
        checkpoint_factor=None,
        eval_interval=1000,
        do_test=False,
        zero_optimization={"stage": 0},
    )


def test_sigterm_over_pdsh_saves_on_every_node_and_leaves_no_process(sshd, tmp_path):
    from tests.train_helpers import write_config
    from tests.training.lifecycle_helpers import BackgroundRun

    cfg = write_config(tmp_path, "pdsh", train_iters=1000, **two_node_training(sshd, tmp_path))
    run = BackgroundRun(cfg, tmp_path / "pdsh.out", PDSH_SSH_ARGS_APPEND=sshd.ssh_args)
    try:
        run.wait_for("iter 2/1000")
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.wait() == 0, run.text()[-3000:]
        assert run.pids() == []
    finally:
        run.kill_all()
    out = run.text()
    # Each node's agent got the stop on its control channel and passed it to its rank.
    assert out.count("stop requested by deepy.py: SIGTERM to 1 rank(s)") == 2, out[-3000:]
    [line] = [ln for ln in out.splitlines() if ln.startswith("deepy: stopped by")]
    ckpt = tmp_path / "pdsh" / "ckpt"
    tag = (ckpt / "latest").read_text()
    assert line == f"deepy: stopped by SIGTERM; checkpoint saved in {ckpt / tag}"
    assert [p.name for p in ckpt.glob("global_step*")] == [tag]
    assert "Traceback" not in out
    # It loads: the whole model, every weight finite (a resume from a stop-save is tested on
    # one node in tests/training/test_lifecycle.py).
    import torch

    from neox.checkpoint.consolidate import load_model

    model, saved = load_model(str(ckpt))
    assert saved.model.hidden_size == 32
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_kill_9_of_deepy_over_pdsh_saves_and_leaves_no_process(sshd, tmp_path):
    from tests.train_helpers import records, write_config
    from tests.training.lifecycle_helpers import BackgroundRun

    cfg = write_config(tmp_path, "pdsh", train_iters=1000, **two_node_training(sshd, tmp_path))
    run = BackgroundRun(cfg, tmp_path / "pdsh.out", PDSH_SSH_ARGS_APPEND=sshd.ssh_args)
    try:
        run.wait_for("iter 2/1000")
        # deepy.py's ssh clients die with it; each node's agent sees its control channel close
        # (and its ssh session end) and stops its ranks as on SIGTERM: they save and exit.
        run.kill_9_deepy()
    finally:
        run.kill_all()
    # The nodes' log lines came through deepy.py, so they end with it; the metrics file shows
    # the last step, and the checkpoint is of that step.
    steps = [r["step"] for r in records(tmp_path / "pdsh" / "logs") if r["split"] == "train"]
    assert steps[-1] >= 2
    assert (tmp_path / "pdsh" / "ckpt" / "latest").read_text() == f"global_step{steps[-1]}"


def test_sigterm_over_pdsh_while_the_ranks_start_still_reaches_them(sshd, tmp_path):
    from tests.train_helpers import write_config
    from tests.training.lifecycle_helpers import BackgroundRun

    cfg = write_config(tmp_path, "pdsh", train_iters=1000, **two_node_training(sshd, tmp_path))
    run = BackgroundRun(cfg, tmp_path / "pdsh.out", PDSH_SSH_ARGS_APPEND=sshd.ssh_args)
    try:
        run.wait_for("launching 2 rank(s)")  # the ranks do not exist yet
        os.kill(run.proc.pid, signal.SIGTERM)
        start = time.monotonic()
        run.wait()
        assert time.monotonic() - start < 60  # not the whole run
        assert run.pids() == []
    finally:
        run.kill_all()
    out = run.text()
    assert "SIGTERM to 1 rank(s)" in out and "deepy: stopped by SIGTERM" in out, out[-3000:]
    assert "iter 3/1000" not in out
