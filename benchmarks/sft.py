#!/usr/bin/env python
"""SFT with a loss mask against plain training of the same tokens, through the real launcher
(`deepy.py train.py`), on one GPU: issue 21's target is that masking costs no tokens/s (>= 0.98x
plain training at the 1.4B shape).

python benchmarks/sft.py --vocab-file data/20B_tokenizer.json --text data/tinyshakespeare.txt
python benchmarks/sft.py --tiny --vocab-file data/20B_tokenizer.json --text data/tinyshakespeare.txt

The dataset is real text made into prompt/answer documents: tinyshakespeare's speeches are cut
into scenes of 2 to 12 consecutive turns, the first half of a scene's turns is the prompt and
the rest the answer after an "Answer:" line. tools/preprocess_data_with_mask.py (the user's
tool, --append-eod, --mask-before-token the delimiter's ids) writes the tokens and the labels:
-100 on the prompt and delimiter (about half the tokens), the token id on the answer and EOD.

Runs, each configs/pythia/<M>.yml (or configs/tiny.yml + configs/cpu.yml with --tiny) plus an
overlay: bf16, seq 2048, micro batch 4, no activation checkpointing, the GPU defaults (the flat
engine, torch_compile), the same data and steps:
  plain     the text dataset alone: every token trained
  sft       the same text with its label dataset (label_data_paths): the masked loss
  sft_docs  sft with reset_attention_mask + reset_position_ids (pack_impl packed): each
            document attends only within itself (FlexAttention's document block mask)
  plain_repeat  plain again, last: how far two identical runs differ
tokens/s counts every token read (trained or not) and is the mean of the logged steps from
--first on (the run's own metrics.jsonl); trained_tokens is the mean per step of the loss's
denominator; peak memory is torch.cuda.max_memory_allocated as the run logs it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.train_multi_gpu import OVERLAY, free_port, summarize  # noqa: E402

DELIMITER = "\n\nAnswer:"

# Run name -> config keys on top of the model's file and the overlay ("LABELS" is replaced by
# the label dataset's prefix).
RUNS: dict[str, dict[str, Any]] = {
    "plain": {},
    "sft": {"label_data_paths": ["LABELS"]},
    "sft_docs": {
        "label_data_paths": ["LABELS"],
        "pack_impl": "packed",
        "reset_attention_mask": True,
        "reset_position_ids": True,
    },
    # plain again, last: the run-to-run spread of the baseline the ratio is read against.
    "plain_repeat": {},
}

# The CPU smoke run: configs/tiny.yml's 2-layer model on configs/cpu.yml's 2 CPU ranks.
TINY: dict[str, Any] = {
    "seq_length": 128,
    "max_position_embeddings": 128,
    "train_micro_batch_size_per_gpu": 2,
    "precision": "fp32",
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
}


def scenes(text: str, seed: int = 0) -> list[str]:
    """Prompt/answer documents from a play: runs of 2-12 consecutive speeches, the first half
    of them the prompt, the rest the answer after DELIMITER."""
    turns = [t.strip() for t in text.split("\n\n") if t.strip()]
    rng = np.random.default_rng(seed)
    docs, i = [], 0
    while i + 2 <= len(turns):
        k = int(rng.integers(2, 13))
        scene, i = turns[i : i + k], i + k
        half = len(scene) // 2
        docs.append("\n\n".join(scene[:half]) + DELIMITER + "\n" + "\n\n".join(scene[half:]))
    return docs


def delimiter_ids(vocab_file: str) -> list[int]:
    from neox.tokenizer import build_tokenizer

    return list(build_tokenizer("HFTokenizer", vocab_file).encode(DELIMITER))


def build_dataset(text_file: Path, vocab_file: str, out: Path) -> tuple[Path, Path, dict]:
    """The SFT dataset under `out` (kept if already there): (text prefix, label prefix, stats)."""
    prefix = out / "sft"
    text_prefix, label_prefix = Path(f"{prefix}_text_document"), Path(f"{prefix}_label_document")
    if not Path(f"{label_prefix}.idx").is_file():
        out.mkdir(parents=True, exist_ok=True)
        jsonl = out / "sft.jsonl"
        with open(jsonl, "w") as f:
            for doc in scenes(text_file.read_text()):
                f.write(json.dumps({"text": doc}) + "\n")
        cmd = [sys.executable, str(ROOT / "tools" / "preprocess_data_with_mask.py")]
        cmd += ["--input", str(jsonl), "--output-prefix", str(prefix), "--append-eod"]
        cmd += ["--tokenizer-type", "HFTokenizer", "--vocab-file", vocab_file, "--workers", "1"]
        cmd += ["--mask-before-token", ",".join(map(str, delimiter_ids(vocab_file)))]
        cmd += ["--no-progress"]
        env = common.child_env()
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return text_prefix, label_prefix, label_stats(text_prefix, label_prefix)


def label_stats(text_prefix: Path, label_prefix: Path) -> dict[str, Any]:
    """How much of the dataset is masked, and whether every document found its delimiter."""
    from neox.data.indexed import IGNORE_INDEX, IndexedDataset

    text, label = IndexedDataset(str(text_prefix)), IndexedDataset(str(label_prefix))
    labels = np.concatenate([label.get(i) for i in range(len(label.sizes))])
    tokens = np.concatenate([text.get(i) for i in range(len(text.sizes))])
    masked = labels == IGNORE_INDEX
    # A document that lacked the delimiter would be trained from its first token.
    unmatched = sum(int(label.get(i, 0, 1)[0] != IGNORE_INDEX) for i in range(len(label.sizes)))
    return {
        "documents": int(len(text.sizes)),
        "tokens": int(tokens.size),
        "mean_document_tokens": float(text.sizes.mean()),
        "masked_fraction": float(masked.mean()),
        "labels_equal_tokens_where_trained": bool((labels[~masked] == tokens[~masked]).all()),
        "documents_without_delimiter": unmatched,
    }


def run_config(args, run: str, work: Path, text: Path, labels: Path) -> Path:
    cfg = {**OVERLAY, "num_gpus": 1, "model_parallel_size": 1, "pipe_parallel_size": 1}
    cfg |= {
        "train_micro_batch_size_per_gpu": 4,
        "seq_length": 2048,
        "max_position_embeddings": 2048,
    }
    cfg |= {"train_iters": args.iters, "lr_decay_iters": args.iters, "data_path": str(text)}
    cfg |= {"log_dir": str(work / run), "master_port": free_port()}
    cfg |= {"tokenizer_type": "HFTokenizer", "vocab_file": args.vocab_file}
    if args.tiny:
        cfg |= TINY | {"num_gpus": 2}
    for key, value in RUNS[run].items():
        cfg[key] = [str(labels)] if value == ["LABELS"] else value
    path = work / f"{run}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(args, overlay: Path, log: Path) -> tuple[int, float]:
    """`deepy.py train.py <model files> <overlay>`, output to `log`; (exit code, seconds)."""
    if args.tiny:
        model = [ROOT / "configs" / "tiny.yml", ROOT / "configs" / "cpu.yml"]
    else:
        model = [ROOT / "configs" / "pythia" / f"{args.model}.yml"]
    cmd = [sys.executable, str(ROOT / "deepy.py"), "train.py", *map(str, model), str(overlay)]
    env = common.child_env()
    if args.tiny:
        env["DS_ACCELERATOR"] = "cpu"
    tick = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.perf_counter() - tick


def measure(args, run: str, work: Path, text: Path, labels: Path) -> dict[str, Any]:
    overlay = run_config(args, run, work, text, labels)
    code, seconds = launch(args, overlay, work / f"{run}.log")
    rec: dict[str, Any] = {"model": "tiny" if args.tiny else args.model, "run": run}
    rec |= {"exit_code": code, "wall_s": round(seconds, 1), "config": RUNS[run]}
    metrics = work / run / "metrics.jsonl"
    if code == 0 and metrics.is_file():
        rec |= summarize(metrics, args.first)
        train = [json.loads(line) for line in metrics.read_text().splitlines()]
        train = [r for r in train if r.get("split") == "train" and r["step"] >= args.first]
        rec["trained_tokens_per_step"] = sum(r["trained_tokens"] for r in train) / len(train)
        rec["tokens_per_step"] = train[0]["tokens_per_s"] * train[0]["step_time_s"]
    else:
        log = work / f"{run}.log"
        rec["error"] = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    return rec


def print_table(records: list[dict[str, Any]]) -> None:
    base = next((r for r in records if r["run"] == "plain" and "tokens_per_s" in r), None)
    print(
        f"{'run':>9} {'tok/s':>9} {'x plain':>8} {'trained/step':>13} {'peak GiB':>9} {'loss':>16}"
    )
    for r in records:
        if "tokens_per_s" not in r:
            print(f"{r['run']:>9} failed (exit {r['exit_code']}), see its log")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else "-"
        mem = f"{r['peak_mem_gb']:.2f}" if r["peak_mem_gb"] is not None else "-"
        loss = f"{r['losses'][0]:.2f} -> {r['loss_tail_mean']:.2f}"
        print(
            f"{r['run']:>9} {r['tokens_per_s']:>9.0f} {ratio:>8} "
            f"{r['trained_tokens_per_step']:>13.0f} {mem:>9} {loss:>16}"
        )
    if base and any(r["run"] == "sft" and "tokens_per_s" in r for r in records):
        sft = next(r for r in records if r["run"] == "sft")
        print(f"sft / plain = {sft['tokens_per_s'] / base['tokens_per_s']:.3f}x (target >= 0.98x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="1-4B")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--first", type=int, default=10, help="first logged step averaged")
    p.add_argument("--vocab-file", default="data/20B_tokenizer.json")
    p.add_argument("--text", default="data/tinyshakespeare.txt", help="the play made into SFT data")
    p.add_argument("--timeout", type=float, default=200, help="seconds per run")
    p.add_argument("--work-dir", default=None, help="keep data, configs, logs and metrics here")
    p.add_argument("--json", default=None, help="append one JSON record per run here")
    p.add_argument(
        "--tiny", action="store_true", help="configs/tiny.yml on 2 CPU ranks: a smoke test"
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.iters, args.first = min(args.iters, 6), min(args.first, 3)
    for name in ("vocab_file", "text"):
        if not Path(getattr(args, name)).is_file():
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} not found")
    args.vocab_file = str(Path(args.vocab_file).resolve())
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="neox_sft_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir: {work}", flush=True)
    text, labels, stats = build_dataset(Path(args.text), args.vocab_file, work / "data")
    common.emit({"dataset": stats}, args.json)
    records = []
    for run in args.runs:
        rec = measure(args, run, work, text, labels)
        records.append(rec)
        common.emit(rec, args.json)
    print_table(records)
    return 0 if all(r["exit_code"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
