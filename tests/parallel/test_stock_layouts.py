"""The shipped configs' own keys train under PP=2, TP=2 and ZeRO-1/2/3 DP=2 on CPU ranks.

Only sizes, tokenizer, layout and schedule are replaced (tests/stock_config_helpers.py); one
representative per group of shipped configs, chosen so that together they hold every key value
any shipped model config sets."""

import math

import pytest
import yaml

from tests.port_helpers import free_port
from tests.stock_config_helpers import (
    LAYOUTS_2,
    REPRESENTATIVES,
    features,
    shipped_model_configs,
    stock_keys,
)
from tests.train_helpers import SHORT_RUN, losses, make_dataset, records, train, write_config

STEPS = 2


def test_representatives_hold_every_shipped_configs_keys():
    covered = set().union(*(features(name) for name in REPRESENTATIVES))
    for name in shipped_model_configs():
        missing = features(name) - covered
        assert not missing, f"{name} sets {sorted(missing)}: add it to REPRESENTATIVES"


def test_stock_runs_replace_only_sizes_and_run_keys():
    """What a stock run changes of the file: nothing outside the size and run keys but the
    precision CPU ranks lack (fp16 -> bf16) and the layout's ZeRO stage."""
    from neox.config.loader import read_config_file
    from tests.stock_config_helpers import ROOT, RUN_KEYS, SCALED_KEYS, SIZE_KEYS

    for name in REPRESENTATIVES:
        own = read_config_file(ROOT / name)
        cfg = stock_keys(name, LAYOUTS_2["zero3"], num_gpus=2)
        assert set(own) - set(cfg) <= SIZE_KEYS | RUN_KEYS, name
        changed = {k for k in own if cfg.get(k) != own[k]}
        allowed = SIZE_KEYS | RUN_KEYS | SCALED_KEYS | {"fp16", "bf16", "zero_optimization"}
        assert changed <= allowed, (name, changed - allowed)
        assert cfg["zero_optimization"]["stage"] == 3
        assert {k: v for k, v in cfg["zero_optimization"].items() if k != "stage"} == {
            k: v for k, v in (own.get("zero_optimization") or {}).items() if k != "stage"
        }


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS_2)
@pytest.mark.parametrize("name", REPRESENTATIVES)
def test_stock_keys_train_under_layout(name, layout, tmp_path):
    make_dataset(tmp_path / "data" / "chars", docs=120)
    cfg = stock_keys(name, LAYOUTS_2[layout], num_gpus=2)
    cfg |= {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "train_iters": STEPS,
        "lr_decay_iters": STEPS,
        "checkpoint_factor": None,
        "extra_save_iters": None,
        "save": None,
        "load": None,
        "eval_interval": 100,
        "eval_iters": 1,
        "do_test": False,
        "log_interval": 1,
        "num_workers": 0,
        "split": "8,1,1",
        "data_path": str(tmp_path / "data" / "chars"),
        "log_dir": str(tmp_path / "logs"),
        "tensorboard_dir": None,
        "master_port": free_port(),
    }
    path = tmp_path / "stock.yml"
    path.write_text(yaml.safe_dump(cfg))
    train(path)
    curve = losses(tmp_path / "logs")
    assert sorted(curve) == list(range(1, STEPS + 1)), curve
    assert all(math.isfinite(v) for v in curve.values()), curve


@pytest.mark.slow
def test_pipeline_with_wall_clock_breakdown_trains(tmp_path):
    """Regression: DeepSpeed 0.19's PipelineEngine and its backward hook both started the
    backward timers (`bwd_microstep timer has already been started` at the first backward);
    the adapter's time_pipeline_backward_once keeps one start, and the timers still report."""
    make_dataset(tmp_path / "data" / "chars")
    cfg = write_config(
        tmp_path,
        "pp",
        pipe_parallel_size=2,
        wall_clock_breakdown=True,
        steps_per_print=1,
        **SHORT_RUN,
    )
    out = train(cfg).stdout
    assert "bwd_microstep" in out, out[-3000:]
    assert sorted(losses(tmp_path / "pp" / "logs")) == [1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2", "tp2_pp2"])
def test_fp32_pipeline_at_zero_stage_0_clips_with_the_whole_models_norm(layout, tmp_path):
    """DeepSpeed 0.19 clipped fp32 ZeRO-0 pipelines with the first stage's norm (and only the
    tensor-split gradients of later stages); the adapter's clip_pipeline_fp32_gradients clips
    with every stage's. Clipping at 0.5 is active at every step here (norms above 1), so the
    losses and norms equal one rank's only with the right norm."""
    make_dataset(tmp_path / "data" / "chars")
    runs = {
        "dense": dict(num_gpus=1),
        layout: dict(num_gpus=2 if layout == "pp2" else 4, pipe_parallel_size=2)
        | (dict(model_parallel_size=2) if layout == "tp2_pp2" else {}),
    }
    logs = {}
    for name, keys in runs.items():
        cfg = write_config(tmp_path, name, zero_optimization={"stage": 0}, **SHORT_RUN, **keys)
        train(cfg)
        logs[name] = [r for r in records(tmp_path / name / "logs") if r["split"] == "train"]
    for one, piped in zip(logs["dense"], logs[layout], strict=True):
        assert one["grad_norm"] > 0.5  # clipped
        assert piped["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), (one, piped)
        assert piped["loss"] == pytest.approx(one["loss"], rel=1e-5), (one, piped)
