"""deepy.py: dry runs and config errors (its main, in this process); end to end, a missing data
file before launch and rank death. Its CPU ranks training on layered configs, a path with a space
reaching them: tests/test_demo.py; the all-reduce and config on an agent's ranks:
tests/launcher/test_launch.py."""

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.process_helpers import child_env

ROOT = Path(__file__).resolve().parents[1]


def deepy(*args, timeout=240, cwd=ROOT):
    env = child_env(DS_ACCELERATOR="cpu")
    return subprocess.run(
        [sys.executable, str(ROOT / "deepy.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


@pytest.fixture
def dry_run(capsys, monkeypatch):
    """deepy.py's main in this process (a dry run launches nothing): its exit status, stdout and
    stderr."""
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import deepy

    def run(*args) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = deepy.main([*map(str, args), "--dry-run"])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    neox_log = logging.getLogger("neox")
    level = neox_log.level
    yield run
    neox_log.setLevel(level)  # --verbose set it to debug, for this process's later tests too


def test_dry_run_of_20b_with_local_setup(dry_run):
    r = dry_run("train.py", "configs/20B.yml", "configs/local_setup.yml")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "# deepspeed config" in out and "# launch command" in out
    assert "num_layers: 44" in out and "hidden_size: 6144" in out
    ds = json.loads(out.split("# deepspeed config\n", 1)[1].split("# launch command", 1)[0])
    assert ds["zero_optimization"]["stage"] == 1
    assert ds["fp16"]["enabled"] is True
    # tp 2 x pp 4 needs 8 ranks; the dry run plans them even on this machine.
    assert "--devices=0,1,2,3,4,5,6,7" in out and "data_parallel: 1" in out
    # The estimate, for that layout (tools/estimate.py's report; tests/tools/test_estimate.py).
    estimate = out.split("# estimate", 1)[1].split("# deepspeed config", 1)[0]
    assert "tp 2 x pp 4 x dp 1" in estimate and "ZeRO-1*" in estimate
    assert "tokens/s" in estimate


def test_a_gpu_launch_notes_recompute_the_gpu_does_not_need(monkeypatch, capsys):
    """Before a GPU launch deepy.py reads the GPU's memory: configs/20B.yml cut to 12 layers at
    TP2 x PP2 keeps the file's checkpoint_activations, which an 80 GB GPU does not need; a 16 GB
    one gets the fit warning instead."""
    monkeypatch.syspath_prepend(str(ROOT))
    import deepy
    from neox.config import derive, load_config

    cut = {"num_layers": 12, "pipe_parallel_size": 2, "train_micro_batch_size_per_gpu": 2}
    cfg = load_config([str(ROOT / "configs/20B.yml")], overrides=cut).config
    derived = derive(cfg, 4, 50277)
    for gib, expected in ((80, "deepy: note: checkpoint_activations is on"), (16, "warning")):
        monkeypatch.setattr(deepy, "local_gpu_bytes", lambda gib=gib: gib * 2**30)
        deepy.memory_notes(cfg, derived)
        err = capsys.readouterr().err
        assert expected in err and err.count("deepy: ") == 1, err


def test_verbose_sets_log_level_debug(dry_run):
    r = dry_run("train.py", "configs/tiny.yml", "--verbose")
    assert r.returncode == 0, r.stderr
    assert "log_level: debug" in r.stdout.split("# merged config", 1)[1]


def test_dry_run_plans_a_bigger_layout_from_num_gpus(tmp_path, dry_run):
    cfg = tmp_path / "layout.yml"
    cfg.write_text("num_gpus: 16\nmodel_parallel_size: 2\ntrain_micro_batch_size_per_gpu: 4\n")
    r = dry_run("train.py", "configs/tiny.yml", cfg)
    assert r.returncode == 0, r.stderr
    assert "world_size: 16" in r.stdout and "data_parallel: 8" in r.stdout
    assert "global_batch: 32" in r.stdout


def test_bad_config_fails_before_launch_naming_file_and_key(tmp_path, dry_run):
    cfg = tmp_path / "bad.yml"
    cfg.write_text("num_attention_heads: 5\n")
    r = dry_run("train.py", "configs/tiny.yml", cfg)
    assert r.returncode != 0
    assert "hidden_size=64 is not divisible by num_attention_heads=5" in r.stderr
    assert "# launch command" not in r.stdout


def test_missing_data_is_an_error_for_a_real_launch(tmp_path):
    cfg = tmp_path / "paths.yml"
    cfg.write_text(f"data_path: {tmp_path}/nothing\ntokenizer_type: CharLevelTokenizer\n")
    r = deepy("train.py", "configs/tiny.yml", cfg)
    assert r.returncode != 0
    assert "nothing.bin" in r.stderr and "preprocess_data.py" in r.stderr


def probe_config(tmp_path, **extra):
    lines = {
        "num_gpus": 2,
        "tokenizer_type": "CharLevelTokenizer",
        "hidden_size": 96,
        "num_attention_heads": 4,
        "save": str(tmp_path / "dir with space"),
        "log_dir": str(tmp_path),
        "master_port": 29611,
        **extra,
    }
    path = tmp_path / "probe.yml"
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in lines.items()))
    return path


@pytest.mark.slow
def test_a_dying_rank_makes_deepy_exit_nonzero_quickly(tmp_path):
    start = time.monotonic()
    r = deepy(
        "tests/deepy_probe_helpers.py", probe_config(tmp_path, exit_interval=1, master_port=29612)
    )
    assert r.returncode != 0
    assert time.monotonic() - start < 60
