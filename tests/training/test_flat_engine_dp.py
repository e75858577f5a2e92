"""The flat engine on 2 data-parallel CPU ranks through deepy.py, against DeepSpeed's ZeRO-1
engine: the same losses, and each engine resumes the other's checkpoint (DeepSpeed's at another
data-parallel size)."""

import shutil
from pathlib import Path

import pytest

from tests.train_helpers import losses, make_dataset, records, train, write_config

pytestmark = pytest.mark.slow


def only_step3(src: Path, dst: Path) -> None:
    """A checkpoint directory holding src's global_step3 alone, named by `latest`."""
    dst.mkdir(parents=True)
    shutil.copytree(src / "global_step3", dst / "global_step3")
    (dst / "latest").write_text("global_step3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flat_dp")
    make_dataset(tmp / "data" / "chars")
    out = {}
    for name, flat in (("flat", True), ("ds", False)):
        r = train(write_config(tmp, name, flat_engine=flat))
        out[name] = (r.stdout + r.stderr, losses(tmp / name / "logs"))
    return tmp, out


def test_two_ranks_train_as_deepspeed_zero1_does(runs):
    tmp, out = runs
    assert "neox's flat engine" in out["flat"][0]
    assert "neox's flat engine" not in out["ds"][0]
    flat, ds = out["flat"][1], out["ds"][1]
    assert sorted(flat) == [1, 2, 3, 4, 5, 6]
    for step in flat:
        assert flat[step] == pytest.approx(ds[step], rel=1e-5), step
    norms = {
        n: [r["grad_norm"] for r in records(tmp / n / "logs") if "grad_norm" in r] for n in out
    }
    assert norms["flat"] == pytest.approx(norms["ds"], rel=1e-4)
    # The state by plain name alone: each data-parallel rank wrote what its partition holds.
    step = tmp / "flat" / "ckpt" / "global_step6"
    assert not list(step.glob("*.pt"))
    assert (step / "state" / "rank_00000.safetensors").is_file()
    assert (step / "state" / "rank_00001.safetensors").is_file()


def test_deepspeed_resumes_the_flat_engine_checkpoint(runs):
    tmp, out = runs
    only_step3(tmp / "flat" / "ckpt", tmp / "to_ds" / "ckpt")
    r = train(write_config(tmp, "to_ds", flat_engine=False))
    assert "resum" in r.stdout
    resumed = losses(tmp / "to_ds" / "logs")
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(out["flat"][1][step], rel=1e-5), step


def test_flat_engine_resumes_deepspeed_at_another_data_parallel_size(runs):
    """DeepSpeed's 2-rank ZeRO-1 checkpoint on one rank (twice the accumulation steps, so the
    same global batch): the optimizer partitions are joined, the run goes on as it would."""
    tmp, out = runs
    only_step3(tmp / "ds" / "ckpt", tmp / "one" / "ckpt")
    r = train(write_config(tmp, "one", num_gpus=1, gradient_accumulation_steps=4))
    assert "neox's flat engine" in r.stdout + r.stderr
    resumed = losses(tmp / "one" / "logs")
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(out["ds"][1][step], rel=1e-4), step
