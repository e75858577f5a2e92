"""Shared pieces of the tests that train on CPU ranks: tiny datasets and configs, and two ways to
run an entry script (train.py, eval.py, generate.py) on its ranks: `train` / `run_here` start the
ranks from this process (what most tests need: the loop, checkpoints, evaluation), `run_deepy` /
`run_train` go through deepy.py and DeepSpeed's launcher (kept for the launcher's own tests)."""

import atexit
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from neox.data.indexed import IndexedDatasetBuilder
from tests.parallel.rank_helpers import RANKS
from tests.port_helpers import free_port
from tests.process_helpers import child_env

ROOT = Path(__file__).resolve().parents[1]

# For tests marked `gpu` that launch two ranks, one GPU each. tests/conftest.py skips `gpu`
# tests without CUDA, these below 2 GPUs and `multigpu` ones below 4; `pytest -m two_gpus`
# runs them alone (benchmarks/multi_gpu.sh tests2).
TWO_GPUS = pytest.mark.two_gpus

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


def train(*configs: Path) -> subprocess.CompletedProcess:
    """train.py on the config's CPU ranks, started from this process; asserts success."""
    return run_here("train.py", *configs)


def run_here(
    script: str, *configs: Path, check: bool = True, timeout: float = 400, **env: str
) -> subprocess.CompletedProcess:
    """`deepy.py SCRIPT CONFIGS` without deepy.py: the entry script's main() on the config's
    num_gpus gloo ranks, forked from the server of rank_helpers.RANKS; extra environment
    variables for the ranks.

    deepy.py's resume line (`resuming from ...`, checked by the same function) starts stdout;
    then each rank's stdout and stderr, rank 0 first. The exit status is the first failing
    rank's. Asserts success unless check=False."""
    from neox.checkpoint.compat import check_resume
    from neox.config import derive, load_config
    from neox.plan.preflight import NEEDS_CHECKPOINT, preflight

    loaded = load_config([str(c) for c in configs])
    cfg = loaded.config
    world = cfg.launcher.num_gpus or 1
    vocab, problems = preflight(loaded, script)
    assert not problems, problems
    resume = ""
    if Path(script).name not in NEEDS_CHECKPOINT:
        resume = check_resume(cfg, derive(cfg, world, vocab)) or ""
    out = Path(cfg.logging.log_dir or configs[-1].parent) / f"{Path(script).stem}-ranks"
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [str(c) for c in configs]
    ranks = [
        RANKS.Process(target=_rank, args=(script, argv, rank, world, port, str(out), env))
        for rank in range(world)
    ]
    for p in ranks:
        p.start()
    codes = _join(ranks, timeout)
    # A rank that died before redirecting its output left no file (its error went to ours).
    files = [out / f"{r}.{stream}" for stream in ("out", "err") for r in range(world)]
    texts = [f.read_text() if f.is_file() else "" for f in files]
    failed = [c for c in codes if c != 0]
    r = subprocess.CompletedProcess(
        [script, *argv],
        failed[0] if failed else 0,
        (resume + "\n" if resume else "") + "".join(texts[:world]),
        "".join(texts[world:]),
    )
    if check:
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


def _join(ranks: list, timeout: float) -> list[int]:
    """Exit codes; once one rank has failed, the others get 30 s before they are killed (a
    peer waiting in a collective for a dead rank would otherwise wait for gloo's timeout)."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in ranks) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in ranks):
            deadline = min(deadline, time.monotonic() + 30)
        time.sleep(0.1)
    for p in ranks:
        if p.is_alive():
            p.kill()
        p.join()
    return [p.exitcode for p in ranks]


def _rank(
    script: str, argv: list[str], rank: int, world: int, port: int, out: str, env: dict
) -> None:
    """One rank: the environment DeepSpeed's launcher gives it, its output into out/RANK.out and
    out/RANK.err (file descriptors, so native output is kept too), then SCRIPT's main()."""
    os.environ.update(
        env,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
    )
    for fd, stream in ((1, "out"), (2, "err")):
        with open(f"{out}/{rank}.{stream}", "w") as f:
            os.dup2(f.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if "TORCH_LOGS" in env:  # torch reads it once, at its import (in the server, before)
        import torch._logging

        torch._logging._init_logs()
    main = runpy.run_path(str(ROOT / script), run_name="rank")["main"]
    code = main(argv)
    atexit._run_exitfuncs()  # a multiprocessing child leaves by os._exit, skipping them (wandb's)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def run_deepy(
    script: str,
    *configs: Path,
    cpu: bool = True,
    stdin: str | None = None,
    check: bool = True,
    **env: str,
) -> subprocess.CompletedProcess:
    """`python deepy.py <script> <configs>` with extra environment variables; asserts success
    unless check=False."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "deepy.py"), script, *map(str, configs)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env=deepy_env(cpu=cpu, **env),
    )
    if check:
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


def losses(log_dir: Path, split: str = "train") -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == split}


def deepy_env(cpu: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a deepy.py child: this checkout first on PYTHONPATH, CPU ranks (or,
    with cpu=False, GPU ranks: conftest.py's DS_ACCELERATOR=cpu is not passed on)."""
    env = child_env()
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    elif env.get("DS_ACCELERATOR") == "cpu":
        del env["DS_ACCELERATOR"]
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
