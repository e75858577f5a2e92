"""The training loop on a GPU does not wait for the device once a step: each step's metrics
are read after the next step is queued (DeviceScalars), the stop signal is agreed on over a CPU
group, and the flat engine keeps its norm and skip flag on the device."""

import json
import subprocess
import sys

import pytest

from tests.train_helpers import ROOT, SHORT_RUN, deepy_env, make_dataset, write_config

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

ITERS = 16


def test_loop_syncs_fewer_times_than_it_steps(tmp_path):
    make_dataset(tmp_path / "data" / "chars", docs=400)
    cfg = write_config(
        tmp_path,
        "syncs",
        num_gpus=1,
        **{**SHORT_RUN, "train_iters": ITERS},
        gradient_accumulation_steps=1,
        log_interval=4,
        bf16={"enabled": True},
        torch_compile=False,
    )
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "training" / "loop_syncs_helpers.py"), str(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=deepy_env(cpu=False),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["engine"] == "FlatEngine" and out["loss"] == out["loss"]  # trained, finite
    # One sync a step (a loss .item(), a norm float()) would give >= ITERS; what remains is
    # setup, the first step and the log lines.
    assert sum(out["sites"].values()) < ITERS // 2, out["sites"]
