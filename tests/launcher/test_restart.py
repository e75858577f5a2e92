"""What a relaunch under max_restarts resumes from, and when max_restarts cannot work."""

import logging
import os
import time

import pytest

from neox.config import load_dict
from neox.launcher import build_launch
from neox.launcher.liveness import heartbeat_path, stalest
from neox.launcher.reach import check_nodes_reachable
from neox.launcher.restart import launch_with_restarts, restart_problem, resume_config


def test_a_relaunch_resumes_its_own_newest_checkpoint_once_save_holds_one(tmp_path):
    save, pretrained = tmp_path / "ckpt", tmp_path / "pretrained"
    cfg = load_dict(
        {"save": str(save), "load": str(pretrained), "finetune": True, "max_restarts": 2}
    )
    # Nothing saved yet: the relaunch starts as the first launch did (from the pretrained load).
    assert resume_config(cfg) is cfg
    save.mkdir()
    (save / "latest").write_text("global_step4")
    again = resume_config(cfg)
    # Its own checkpoint, as its own run: not a finetune from it (that would restart at 0).
    assert again.checkpoint.load == str(save) and not again.training.finetune
    assert cfg.checkpoint.load == str(pretrained) and cfg.training.finetune  # left as it was


def test_max_restarts_needs_save_for_train_py_only():
    cfg = load_dict({"max_restarts": 1})
    assert restart_problem(cfg, "train.py").startswith("max_restarts=1 needs `save`")
    assert restart_problem(cfg, "generate.py") is None  # run once, never restarted
    assert restart_problem(load_dict({}), "train.py") is None


def test_the_stalest_rank_beyond_the_timeout_is_named_and_one_without_a_step_is_not_timed(
    tmp_path,
):
    now = time.time()
    for rank, idle in ((0, 2.0), (1, 9.0)):
        path = heartbeat_path(str(tmp_path), rank)
        open(path, "w").close()
        os.utime(path, (now - idle, now - idle))
    # Rank 2 has finished no step: no file, not timed however long it builds or loads.
    rank, seconds = stalest(str(tmp_path), [0, 1, 2], timeout_s=5)
    assert rank == 1 and 9 <= seconds < 60
    assert stalest(str(tmp_path), [0, 1, 2], timeout_s=10) is None
    assert stalest(str(tmp_path), [0, 2], timeout_s=5) is None


@pytest.mark.slow
def test_a_relaunch_to_a_node_that_no_longer_answers_ends_the_run_naming_it(tmp_path, caplog):
    # The first launch: two local ranks, rank 1 dies (a failure a relaunch may get past).
    script = tmp_path / "train.py"
    script.write_text("import os, sys\nsys.exit(1 if os.environ['RANK'] == '1' else 0)\n")
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest").write_text("global_step4")
    cfg = load_dict({"num_gpus": 2, "save": str(save), "load": str(save), "max_restarts": 2})
    first = build_launch(cfg.launcher, str(script), [], cpu=True)
    # The relaunch's hostfile names a node ssh cannot reach: checked before anything starts.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\nnode-down.invalid slots=1\n")

    def relaunch_plan(relaunch, environ):
        lc = relaunch.launcher.model_copy(update={"hostfile": str(hostfile), "num_gpus": 1})
        plan = build_launch(lc, str(script), [], cpu=True, environ=environ)
        check_nodes_reachable(plan)
        return plan

    with caplog.at_level(logging.INFO, logger="neox.launcher"):
        result = launch_with_restarts(cfg, str(script), relaunch_plan, first)
    assert result.code == 1 and result.retry
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("launching 2 rank(s)") for line in lines) == 1, lines
    [refused] = [line for line in lines if line.startswith("restart 1/2 not launched")]
    assert "node-down.invalid" in refused, refused
    assert refused.endswith(f"the same command resumes from {save}/global_step4"), refused
