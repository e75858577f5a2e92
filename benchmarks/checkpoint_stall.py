#!/usr/bin/env python
"""The stall a checkpoint save adds to training, sync against async_save, through
`deepy.py train.py`, both in one invocation.

python benchmarks/checkpoint_stall.py configs/pythia/410M.yml configs/local_setup.yml \
    --save-interval 10 --train-iters 40 --out /tmp/stall
python benchmarks/checkpoint_stall.py --tiny                    # CPU smoke run (2 CPU ranks)
python benchmarks/checkpoint_stall.py configs/pythia/1-4B.yml benchmarks/stall-1-4b.yml \
    --random-tokens --out /tmp/stall               # issue 35's bound on one GPU (and 6.9B DP=4)

Each mode trains the same config from scratch, saving every --save-interval steps into its own
directory under --out. Per mode it reports the stall (`save_time_s`: the time the training
loop spent in the save call; async: the copy to host memory, plus `save_wait_s`, the wait for
the previous save's write when saves come closer together than a write takes), the mean step
time of the steps
right after a save and of the others (a background write competing with training shows
there), the wall time of the run, and the size of the last checkpoint. One JSON line per mode
(--json appends them to a file). Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

MODES = {"sync": False, "async": True}


def tiny_setup(out: Path) -> list[Path]:
    """A 2-rank CPU config over random char-level documents."""
    import numpy as np

    from neox.data.indexed import IndexedDatasetBuilder

    prefix = out / "data" / "chars"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for _ in range(200):
        builder.add_item(np.append(rng.integers(1, 256, rng.integers(40, 200)), 0))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    cfg = dict(
        common.TINY,
        num_gpus=2,
        data_path=str(prefix),
        split="98,1,1",
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=1,
        optimizer={"type": "Adam", "params": {"lr": 1e-3}},
        zero_optimization={"stage": 1},
        eval_interval=10_000,
        do_test=False,
        num_workers=0,
    )
    path = out / "tiny.yml"
    path.write_text(yaml.safe_dump(cfg))
    return [path]


def random_tokens(out: Path, vocab: int = 50_000, docs: int = 2_000) -> Path:
    """An overlay naming a dataset of uniformly random ids (2,048-token documents) under out."""
    import numpy as np

    from neox.data.indexed import IndexedDatasetBuilder

    prefix = out / "data" / "random"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    if not Path(str(prefix) + ".idx").is_file():
        rng = np.random.default_rng(0)
        builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
        for _ in range(docs):
            builder.add_item(rng.integers(1, vocab, 2048, dtype=np.uint16))
            builder.end_document()
        builder.finalize(str(prefix) + ".idx")
    overlay = out / "random_tokens.yml"
    keys = {"data_path": str(prefix), "split": "100,0,0", "eval_iters": 0, "do_test": False}
    overlay.write_text(yaml.safe_dump(keys))
    return overlay


def run_mode(configs: list[Path], out: Path, mode: str, args: argparse.Namespace) -> dict:
    here = out / mode
    overlay = {
        "save": str(here / "ckpt"),
        "load": None,
        "checkpoint_factor": args.save_interval,
        "train_iters": args.train_iters,
        "async_save": MODES[mode],
        "keep_last_n_checkpoints": 2,
        "log_dir": str(here / "logs"),
        "tensorboard_dir": None,
        "log_interval": 1,
    }
    here.mkdir(parents=True, exist_ok=True)
    (here / "overlay.yml").write_text(yaml.safe_dump(overlay))
    # The checkout first, keeping what the environment already puts on the path (a device
    # image's installed wheels, say).
    env = common.child_env()
    if args.tiny:
        env["DS_ACCELERATOR"] = "cpu"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, str(ROOT / "deepy.py"), "train.py", *map(str, configs)]
        + [str(here / "overlay.yml")],
        check=True,
        cwd=ROOT,
        env=env,
    )
    wall = time.perf_counter() - start
    records = [json.loads(x) for x in (here / "logs" / "metrics.jsonl").read_text().splitlines()]
    saves = {r["step"]: r["save_time_s"] for r in records if r["split"] == "save"}
    # The part of each stall spent waiting for the previous save's background write.
    waits = {r["step"]: r.get("save_wait_s", 0.0) for r in records if r["split"] == "save"}
    # Each step's own time as the loop measured it (`step_time_s`), not the gap between two
    # records: the loop writes a record a step late (it reads the loss without waiting), and
    # flushes it before a save, so record gaps put parts of the neighbouring steps in.
    took = {r["step"]: r["step_time_s"] for r in records if r["split"] == "train"}
    after, other = [], []
    for step in sorted(took)[1:]:  # the first step compiles and warms up
        (after if step - 1 in saves else other).append(took[step])
    latest = (here / "ckpt" / "latest").read_text().strip()
    size = sum(f.stat().st_size for f in (here / "ckpt" / latest).rglob("*") if f.is_file())

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    return {
        "benchmark": "checkpoint_stall",
        "mode": mode,
        "saves": len(saves),
        "stall_mean_s": mean(list(saves.values())),
        "stall_max_s": max(saves.values()) if saves else None,
        "stalls_s": [round(saves[k], 3) for k in sorted(saves)],
        "wait_mean_s": mean(list(waits.values())),
        "waits_s": [round(waits[k], 3) for k in sorted(saves)],
        # What a save itself costs the step (issue 35's bound): its stall less the wait for an
        # earlier write, which a save interval longer than a write never pays.
        "own_stall_max_s": max(saves[k] - waits[k] for k in saves) if saves else None,
        "step_after_save_s": mean(after),
        "step_other_s": mean(other),
        "wall_s": wall,
        "checkpoint_bytes": size,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("configs", nargs="*", type=Path, help="the run's YAML configs")
    p.add_argument("--tiny", action="store_true", help="a 2-rank CPU smoke run")
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("/tmp/neox_checkpoint_stall"))
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--json", help="append each result to this file")
    p.add_argument(
        "--random-tokens",
        action="store_true",
        help="train on random ids written under --out (no dataset needed)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep each mode's checkpoints (by default removed once measured: a 6.9B one is ~100 GB)",
    )
    args = p.parse_args(argv)
    if not args.configs and not args.tiny:
        p.error("pass the run's configs, or --tiny")
    args.out.mkdir(parents=True, exist_ok=True)
    configs = tiny_setup(args.out) if args.tiny else args.configs
    if args.random_tokens:
        configs = [*configs, random_tokens(args.out)]
    results = []
    for mode in args.modes:
        results.append(run_mode(configs, args.out, mode, args))
        if not args.keep:
            shutil.rmtree(args.out / mode / "ckpt", ignore_errors=True)
    for record in results:
        common.emit(record, args.json)
    if len(results) == 2 and results[0]["stall_mean_s"] and results[1]["stall_mean_s"]:
        ratio = results[0]["stall_mean_s"] / results[1]["stall_mean_s"]
        print(f"async_save stalls training {ratio:.1f}x less than a synchronous save")
    for record in results:
        if record["own_stall_max_s"] is not None and record["step_other_s"]:
            print(
                f"{record['mode']}: a save's own stall {record['own_stall_max_s']:.2f} s at most "
                f"(less waits for earlier writes {record['waits_s']}), "
                f"one step {record['step_other_s']:.2f} s"
            )


if __name__ == "__main__":
    main()
