"""A new generate.py process's wait for its first token, and what the default decode path costs
against the others, through `python deepy.py generate.py` (input-file mode, greedy).

For each batch size, generate.py is launched in fresh processes with its compilation caches
(Triton's, inductor's) in a directory of this run:
- `cold`: empty caches (a machine's first run: kernels compiled, the fused step's tiles tuned);
- `untuned`: the kernels cached but not the fused step's tuning results (what every process paid
  before the tuning was kept on disk);
- `warm`: everything cached (every later run).
Each launch reports the first line generate.py logged (the decode path), its first token's time
after the rank process started (its own log line), the first batch's set-up (cache, capture,
tuning or compilation) and the tokens/s of its later batches. With --compare-compiled, batches the
fused step does not take also run with `torch_compile: true` and `false` (cold and warm), which
gives the decode steps after which compiling pays: set-up difference over per-step saving.

    python benchmarks/generate_first_token.py --models 410M --batch-sizes 1 16 --compare-compiled
    python benchmarks/generate_first_token.py --tiny --device cpu --new-tokens 8   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.generate import DTYPES, prompts_for, run_config, save_checkpoint  # noqa: E402

FIRST_TOKEN = re.compile(r"first token ([\d.]+) s after this process started .*?batch ([\d.]+) s")
PATH_LINE = re.compile(r"(decode path: .*)$")


def parse_args(argv: list[str]) -> argparse.Namespace:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["410M"], help="configs/pythia/<name>.yml")
    p.add_argument("--tiny", action="store_true", help="shrink each model to a tiny shape")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed batches after the first")
    p.add_argument("--compare-compiled", action="store_true")
    p.add_argument("--workdir", help="where checkpoints, caches and rows go")
    args = p.parse_args(argv)
    if args.device == "cpu":
        args.dtype = "fp32"
    args.hf_compile = args.neox_compiled_step = False
    return args


def launch(configs: list[Path], workdir: Path, name: str, keys: dict, caches: Path, cpu: bool):
    """One deepy.py generate.py launch: (seconds, its log, its rows)."""
    cfg = workdir / f"{name}.yml"
    keys = {**keys, "sample_output_file": str(workdir / f"{name}.jsonl")}
    cfg.write_text(yaml.safe_dump(keys))
    env = common.child_env()
    env.update(
        TRITON_CACHE_DIR=str(caches / "triton"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor")
    )
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [sys.executable, str(ROOT / "deepy.py"), "generate.py", *map(str, configs), str(cfg)]
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    seconds = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in Path(keys["sample_output_file"]).read_text().splitlines()]
    return seconds, r.stdout + r.stderr, rows


def drop_tuning(caches: Path) -> int:
    """Remove Triton's kept tuning results from a cache copy (its compiled kernels stay)."""
    tuned = list((caches / "triton").rglob("*.autotune.json"))
    for f in tuned:
        f.unlink()
    return len(tuned)


def measure(log: str, rows: list[dict], batch: int) -> dict:
    first = FIRST_TOKEN.search(log)
    path = next((m.group(1) for m in map(PATH_LINE.search, log.splitlines()) if m), "?")
    later = rows[batch::batch] or rows[:1]
    return {
        "path": path.removeprefix("decode path: ")[:70],
        "first_token_s": float(first.group(1)) if first else float("nan"),
        "setup_s": float(first.group(2)) if first else float("nan"),
        "tok_s": statistics.median(r["tokens_per_second"] for r in later),
    }


def main(argv: list[str]) -> int:
    import torch

    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    print(
        f"# first token of a new generate.py process, device {args.device}, torch "
        f"{torch.__version__}, {args.dtype}, prompts of {args.prompt_tokens} tokens, "
        f"{args.new_tokens} new, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    )
    print(
        "| model | batch | caches | keys | decode path | first token s | first batch set-up s "
        "| tok/s (later batches) | launch s |"
    )
    print("| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            workdir = Path(args.workdir or tmp) / model_name
            workdir.mkdir(parents=True, exist_ok=True)
            base, override = run_config(args, model_name, workdir)
            save_checkpoint(base, override, dtype)
            for batch in args.batch_sizes:
                prompts = prompts_for(args, batch)
                (workdir / f"p{batch}.txt").write_text("\n".join(prompts) + "\n")
                keys = {
                    "train_micro_batch_size_per_gpu": batch,
                    "sample_input_file": str(workdir / f"p{batch}.txt"),
                }
                variants = [({}, "default")]
                if args.compare_compiled and batch not in (1, 2, 4):
                    variants += [
                        ({"torch_compile": True}, "torch_compile: true"),
                        ({"torch_compile": False}, "torch_compile: false"),
                    ]
                for extra, label in variants:
                    caches = workdir / f"caches{batch}-{len(extra) and label[-4:]}"
                    shutil.rmtree(caches, ignore_errors=True)
                    runs = ["cold", "warm"]
                    for i, state in enumerate(runs + (["untuned"] if not extra else [])):
                        if state == "untuned":
                            if not drop_tuning(caches):
                                continue  # nothing tuned (CPU, or no fused step)
                        name = f"b{batch}-{i}-{abs(hash(label)) % 1000}"
                        seconds, log, rows = launch(
                            [base, override],
                            workdir,
                            name,
                            {**keys, **extra},
                            caches,
                            args.device == "cpu",
                        )
                        m = measure(log, rows, batch)
                        print(
                            f"| {model_name}{' (tiny)' if args.tiny else ''} | {batch} | "
                            f"{state} | {label} | {m['path']} | {m['first_token_s']:.2f} | "
                            f"{m['setup_s']:.2f} | {m['tok_s']:,.0f} | {seconds:.1f} |",
                            flush=True,
                        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
