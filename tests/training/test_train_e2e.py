"""train.py through deepy.py on 2 CPU ranks: metrics, tensorboard, checkpoints, exact resume."""

import shutil

import numpy as np
import pytest
import yaml

from tests.train_helpers import losses, make_dataset, records, train, write_config

pytestmark = pytest.mark.slow


def test_train_checkpoint_and_exact_resume(tmp_path):
    make_dataset(tmp_path / "data" / "chars")

    # One uninterrupted run of 6 steps.
    full = write_config(tmp_path, "full")
    train(full)
    full_losses = losses(tmp_path / "full" / "logs")
    assert sorted(full_losses) == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(v) for v in full_losses.values())
    assert full_losses[6] < full_losses[1]  # it learns
    ckpt = tmp_path / "full" / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "global_step6"
    assert (ckpt / "global_step3" / "config.yml").is_file()
    saved = yaml.safe_load((ckpt / "global_step6" / "config.yml").read_text())
    assert saved["hidden_size"] == 32 and saved["train_iters"] == 6
    assert losses(tmp_path / "full" / "logs", "valid").keys() == {3, 6}
    assert list((tmp_path / "full" / "tb").glob("events.out.tfevents.*"))

    # The same run stopped after step 3 (exit_interval), then resumed from its checkpoint.
    part = write_config(tmp_path, "part", exit_interval=3)
    train(part)
    assert (tmp_path / "part" / "ckpt" / "latest").read_text().strip() == "global_step3"
    shutil.copytree(tmp_path / "part" / "ckpt", tmp_path / "step3")
    resumed = write_config(tmp_path, "part")
    r = train(resumed)
    assert "resuming from" in r.stdout
    part_losses = losses(tmp_path / "part" / "logs")
    assert sorted(part_losses) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert part_losses[step] == pytest.approx(full_losses[step], rel=1e-5, abs=1e-6), step

    # override_lr_scheduler is a no-op because a resumed run always takes its schedule from the
    # config: twice the peak lr gives twice the cosine schedule, not the checkpoint's.
    flat = dict(load=str(tmp_path / "step3"), lr=2.0e-3, override_lr_scheduler=True)
    train(write_config(tmp_path, "newlr", exit_interval=4, **flat))
    [step4] = [x for x in records(tmp_path / "newlr" / "logs") if x["split"] == "train"]
    full = records(tmp_path / "full" / "logs")
    full_lr = {x["step"]: x["lr"] for x in full if x["split"] == "train"}
    assert step4["step"] == 4 and step4["lr"] == pytest.approx(2 * full_lr[4], rel=1e-6)
