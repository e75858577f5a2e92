"""On GPUs with NCCL: TP=2 (with and without sequence parallelism) and PP=2 training through
deepy.py match one GPU; fp16 and bf16 train."""

import math

import pytest

from tests.train_helpers import SHORT_RUN, TWO_GPUS, losses, make_dataset, run_deepy, write_config

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

COMMON = dict(SHORT_RUN, distributed_backend="nccl")


@pytest.fixture
def data(tmp_path):
    make_dataset(tmp_path / "data" / "chars")
    return tmp_path


@TWO_GPUS
def test_tensor_and_pipeline_parallel_match_one_gpu(data):
    runs = {
        "dense": dict(num_gpus=1, master_port=29661),
        "tp2": dict(num_gpus=2, model_parallel_size=2, master_port=29662),
        "pp2": dict(num_gpus=2, pipe_parallel_size=2, master_port=29663),
        # Sequence parallelism on NCCL, its collectives compiled (torch_compile's default).
        "tp2_sp": dict(
            num_gpus=2, model_parallel_size=2, sequence_parallel=True, master_port=29665
        ),
    }
    result = {}
    for name, layout in runs.items():
        run_deepy("train.py", write_config(data, name, **COMMON, **layout), cpu=False)
        result[name] = losses(data / name / "logs")
        print(name, result[name])
    for name in ("tp2", "pp2", "tp2_sp"):
        for step, loss in result["dense"].items():
            assert result[name][step] == pytest.approx(loss, rel=1e-4), (name, step)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_training_runs_and_learns(data, precision):
    section = {"enabled": True}
    if precision == "fp16":
        section.update(loss_scale=0, initial_scale_power=12)
    cfg = write_config(
        data,
        precision,
        **{**COMMON, "train_iters": 20},
        num_gpus=1,
        master_port=29664,
        **{precision: section},
    )
    run_deepy("train.py", cfg, cpu=False)
    curve = losses(data / precision / "logs")
    print(precision, curve)
    assert all(math.isfinite(v) for v in curve.values())
    assert curve[20] < curve[1]
