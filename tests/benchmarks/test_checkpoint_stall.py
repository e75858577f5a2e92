"""benchmarks/checkpoint_stall.py's device plans: the overlays for issue 35's bound (1.4B on one
GPU, 6.9B at DP=4) pass deepy.py's dry run over the random-token data the script writes, so a
device call only has to run them."""

import sys

import pytest

from tests.benchmarks.bench_helpers import ROOT

PLANS = [
    ("configs/pythia/1-4B.yml", "benchmarks/stall-1-4b.yml", "layout: 1 GPU(s)"),
    (
        "configs/pythia/6-9B.yml",
        "benchmarks/stall-6-9b-dp4.yml",
        "layout: 4 GPU(s) = tp 1 x pp 1 x dp 4",
    ),
]


@pytest.mark.parametrize("model,overlay,layout", PLANS, ids=["1-4B", "6-9B-dp4"])
def test_stall_overlays_dry_run_on_random_tokens(
    model, overlay, layout, tmp_path, capsys, monkeypatch
):
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(ROOT)
    sys.modules.pop("deepy", None)
    import deepy
    from benchmarks.checkpoint_stall import random_tokens
    from neox.data.indexed import IndexedDataset

    data = random_tokens(tmp_path, docs=8)
    assert len(IndexedDataset(str(tmp_path / "data" / "random"))) == 8
    assert deepy.main(["train.py", model, overlay, str(data), "--dry-run"]) == 0
    assert layout in capsys.readouterr().out
