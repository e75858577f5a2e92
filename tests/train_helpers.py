"""Shared pieces of the tests that run train.py through deepy.py on CPU ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from neox.data.indexed import IndexedDatasetBuilder
from tests.parallel.parallel_harness import free_port

ROOT = Path(__file__).resolve().parents[1]

# A 5-step run that neither saves nor evaluates: for comparing losses across layouts.
SHORT_RUN = dict(
    train_iters=5,
    checkpoint_factor=None,
    save=None,
    load=None,
    eval_interval=100,
    do_test=False,
    gradient_clipping=0.5,
)


def make_dataset(prefix: Path, docs: int = 60, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for _ in range(docs):
        # Char-level ids; 0 is the end-of-document token.
        builder.add_item(np.append(rng.integers(1, 256, rng.integers(20, 80)), 0))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def write_config(tmp_path: Path, name: str, **overrides) -> Path:
    """A tiny char-level run under tmp_path/name; overrides are flat config keys."""
    cfg = {
        "num_gpus": 2,
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": 32,
        "max_position_embeddings": 32,
        "pos_emb": "rotary",
        "rotary_pct": 0.25,
        "gpt_j_residual": True,
        "tokenizer_type": "CharLevelTokenizer",
        "data_path": str(tmp_path / "data" / "chars"),
        "split": "8,1,1",
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "train_iters": 6,
        "optimizer": {"type": "Adam", "params": {"lr": 1.0e-3}},
        "lr_decay_style": "cosine",
        "warmup": 0.2,
        "eval_interval": 3,
        "eval_iters": 1,
        "log_interval": 1,
        "checkpoint_factor": 3,
        "num_workers": 0,
        "zero_optimization": {"stage": 1},
        # A free port each: test runs in parallel on one machine must not collide.
        "master_port": free_port(),
        "save": str(tmp_path / name / "ckpt"),
        "load": str(tmp_path / name / "ckpt"),
        "log_dir": str(tmp_path / name / "logs"),
        "tensorboard_dir": str(tmp_path / name / "tb"),
        **overrides,
    }
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(*configs: Path, cpu: bool = True) -> subprocess.CompletedProcess:
    return run_deepy("train.py", *configs, cpu=cpu)


def run_deepy(
    script: str, *configs: Path, cpu: bool = True, stdin: str | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """`python deepy.py <script> <configs>`; asserts success unless check=False."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "deepy.py"), script, *map(str, configs)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env=deepy_env(cpu=cpu),
    )
    if check:
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


def losses(log_dir: Path, split: str = "train") -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == split}


def deepy_env(cpu: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a deepy.py child: this checkout first on PYTHONPATH, CPU ranks."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    env.update(extra)
    return env


def run_train(*configs: Path, timeout: float = 400, **env: str) -> subprocess.CompletedProcess:
    """deepy.py train.py CONFIGS with extra environment variables, whatever its exit status."""
    return subprocess.run(
        [sys.executable, str(ROOT / "deepy.py"), "train.py", *map(str, configs)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=deepy_env(**env),
    )


def records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
