"""train.py through deepy.py: TP=2 and PP=2 runs reproduce the single-rank run's losses."""

import pytest

from tests.train_helpers import losses, make_dataset, train, write_config

pytestmark = pytest.mark.slow


def test_tensor_and_pipeline_parallel_training_match_one_rank(tmp_path):
    (tmp_path / "data").mkdir()
    make_dataset(tmp_path / "data" / "chars")
    # ZeRO-1 everywhere: DeepSpeed 0.19.8 clips fp32 pipeline gradients wrongly without ZeRO.
    common = dict(
        train_iters=5,
        checkpoint_factor=None,
        save=None,
        load=None,
        eval_interval=100,
        do_test=False,
        gradient_clipping=0.5,
    )
    runs = {
        "dense": dict(num_gpus=1),
        "tp2": dict(num_gpus=2, model_parallel_size=2, master_port=29651),
        "pp2": dict(num_gpus=2, pipe_parallel_size=2, master_port=29652),
    }
    result = {}
    for name, layout in runs.items():
        train(write_config(tmp_path, name, **common, **layout))
        result[name] = losses(tmp_path / name / "logs")
    assert sorted(result["dense"]) == [1, 2, 3, 4, 5]
    for name in ("tp2", "pp2"):
        for step, loss in result["dense"].items():
            # fp32; the reductions run in another order across ranks.
            assert result[name][step] == pytest.approx(loss, rel=1e-5), (name, step)
