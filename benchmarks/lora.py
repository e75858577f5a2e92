#!/usr/bin/env python
"""LoRA on a Pythia shape on one GPU through the real launcher (`deepy.py train.py`), against
what tools/estimate.py says a full finetune of the same config needs.

python benchmarks/lora.py --vocab-file shared/data/20B_tokenizer.json        # 6-9B, one GPU
python benchmarks/lora.py --runs lora_mb4 --rank 8
python benchmarks/lora.py --tiny                                              # CPU smoke run

Each run: configs/pythia/<M>.yml on one GPU (model_parallel_size 1), seq 2048, bf16, random
tokens, LoRA on the four linears of every layer with the base initialised from `seed` (the
speed and memory of a run on a real base are the same). tokens/s is the mean of the logged
steps from --first on; peak memory is torch.cuda.max_memory_allocated as the run logs it. The
full-finetune line is neox.plan.memory's estimate (tools/estimate.py) for the same config
without LoRA, which must hold gradients, fp32 masters and Adam moments of every parameter.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.train_multi_gpu import (  # noqa: E402
    OVERLAY,
    TINY,
    free_port,
    launch,
    summarize,
    write_random_tokens,
)

# Run name -> config keys on top of the model's file, OVERLAY and the LoRA keys.
RUNS: dict[str, dict[str, Any]] = {
    "lora_mb4": {"train_micro_batch_size_per_gpu": 4},
    "lora_mb8_ckpt": {"train_micro_batch_size_per_gpu": 8, "checkpoint_activations": True},
}


def lora_keys(rank: int) -> dict[str, Any]:
    return {
        "lora_rank": rank,
        "lora_alpha": 2.0 * rank,
        "lora_target_modules": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    }


def run_config(args, run: str, work: Path, data: Path) -> Path:
    cfg = {**OVERLAY, "num_gpus": 1, "model_parallel_size": 1, "pipe_parallel_size": 1}
    cfg |= {"train_iters": args.iters, "lr_decay_iters": args.iters, "data_path": str(data)}
    cfg |= {"log_dir": str(work / run), "master_port": free_port(), "vocab_file": args.vocab_file}
    cfg |= lora_keys(args.rank) | RUNS[run]
    if args.tiny:
        cfg |= TINY | {"num_gpus": 2}
    path = work / f"{run}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def full_finetune_estimate(args, overlay: Path) -> dict[str, float]:
    """GiB a full finetune of the same config needs (the LoRA keys dropped), per the planner."""
    from neox.config import derive, load_config
    from neox.plan.memory import GiB, estimate_memory, training_shape
    from neox.plan.report import estimate_vocab

    loaded = load_config([ROOT / "configs" / "pythia" / f"{args.model}.yml", overlay])
    cfg = loaded.config
    cfg.lora = cfg.lora.model_copy(update={"lora_rank": 0})
    derived = derive(cfg, 1)
    est = estimate_memory(cfg.model, training_shape(cfg, derived, estimate_vocab(cfg, derived)[0]))
    return {
        "full_ft_model_states_gib": est.model_states / GiB,
        "full_ft_peak_allocated_gib": est.peak_allocated / GiB,
        "full_ft_total_gib": est.total / GiB,
        "lora_base_weights_gib": est.weights / GiB,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="6-9B")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--first", type=int, default=8, help="first logged step averaged")
    p.add_argument("--vocab-file", default="shared/data/20B_tokenizer.json")
    p.add_argument("--timeout", type=float, default=280, help="seconds per run")
    p.add_argument("--work-dir", default=None, help="keep configs, logs and metrics here")
    p.add_argument("--json", default=None, help="append one JSON record per run here")
    p.add_argument("--tiny", action="store_true", help="2-layer model on 2 CPU ranks: a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        args.iters, args.first, args.vocab_file = min(args.iters, 6), min(args.first, 3), None
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="neox_lora_"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "random_tokens"
    seq = 64 if args.tiny else 2048
    write_random_tokens(data, 256 if args.tiny else 50277, 8 * 8 * (seq + 1) * args.iters)
    print(f"work dir: {work}", flush=True)
    failed = False
    for run in args.runs:
        overlay = run_config(args, run, work, data)
        config = ROOT / "configs" / "pythia" / f"{args.model}.yml"
        code, seconds, _ = launch(args, config, overlay, work / f"{run}.log")
        rec: dict[str, Any] = {"model": args.model, "run": run, "rank": args.rank}
        rec |= {"exit_code": code, "wall_s": seconds, "config": RUNS[run]}
        metrics = work / run / "metrics.jsonl"
        if code == 0 and metrics.is_file():
            rec |= summarize(metrics, args.first)
        else:
            failed = True
            log = work / f"{run}.log"
            rec["error"] = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        if not args.tiny:
            rec |= full_finetune_estimate(args, overlay)
        common.emit(rec, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
