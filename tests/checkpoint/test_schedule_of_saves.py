"""When checkpoints are written and which ones are kept."""

import pytest

from neox.checkpoint.io import prune_checkpoints, should_save
from neox.config import ConfigError, load_dict


def saved_at(iters: int, **flat) -> list[int]:
    cfg = load_dict({"save": "ckpt", **flat})
    return [i for i in range(1, iters + 1) if should_save(cfg, i)]


def test_linear_log_and_extra_saves():
    assert saved_at(10, checkpoint_factor=4) == [4, 8]
    assert saved_at(70, checkpoint_factor=4, checkpoint_scale="log") == [4, 16, 64]
    assert saved_at(10, checkpoint_factor=4, extra_save_iters=[1, 5]) == [1, 4, 5, 8]
    assert saved_at(10, checkpoint_factor=None) == []


def test_keep_last_n_never_removes_what_latest_names(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / f"global_step{step}").mkdir()
    (tmp_path / "global_step10.partial").mkdir()
    (tmp_path / "latest").write_text("global_step2")  # rolled back by hand
    prune_checkpoints(tmp_path, 2)
    left = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert left == ["global_step10.partial", "global_step2", "global_step6", "global_step8"]


def test_no_save_optim_is_refused_by_name():
    with pytest.raises(ConfigError, match="no_save_optim is not implemented"):
        load_dict({"no_save_optim": True})
