#!/usr/bin/env python
"""Memory estimate (neox/plan/memory.py) against measured peak GPU memory of real training steps.

    python benchmarks/estimate_memory.py            # Pythia 160M/410M/1.4B shapes, one GPU each
    python benchmarks/estimate_memory.py --tiny     # a tiny shape on CPU: the table, no GPU numbers

Each shape runs in its own process: neox's real setup (neox.training.setup.build_run, as
train.py) builds the model and its engine, loop.train_step trains --steps steps on random
tokens, then torch.cuda.max_memory_allocated/reserved are compared with the estimate's
peak_allocated/peak_reserved. Shapes: bf16, ZeRO-1, seq 2048, no activation checkpointing,
flash (SDPA) attention, micro batch 16/8/4; the vocabulary is GPT-NeoX-20B's padded 50304;
neox's defaults otherwise (on a GPU: the flat engine, torch_compile on). The table names the
engine and loss the estimate assumed (for the device the shape ran on) and the engine built.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (config file, micro batch, overrides)
SHAPES = {
    "160M": ("configs/pythia/160M.yml", 16, {}),
    "410M": ("configs/pythia/410M.yml", 8, {}),
    "1.4B": ("configs/pythia/1-4B.yml", 4, {}),
    "tiny": (
        "configs/pythia/14M.yml",
        2,
        dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64),
    ),
}
VOCAB = 50304


def shape_config(name: str) -> dict:
    """Flat config keys of one benchmark shape on top of its Pythia file."""
    from neox.config.loader import merge_files, resolve_paths

    path, micro, extra = SHAPES[name]
    flat, _, _ = merge_files(resolve_paths([str(ROOT / path)]))
    flat.pop("fp16", None)
    flat.update(
        bf16={"enabled": True},
        zero_optimization={"stage": 1},
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=1,
        train_batch_size=None,
        checkpoint_activations=False,
        partition_activations=False,
        attention_impl="flash",
        attention_config=None,
        scaled_upper_triang_masked_softmax_fusion=False,
        # A tokenizer without files, padded to the 20B tokenizer's size.
        tokenizer_type="CharLevelTokenizer",
        vocab_file=None,
        merge_file=None,
        padded_vocab_size=VOCAB,
        data_path=None,
        num_gpus=1,
        **extra,
    )
    if "seq_length" in extra:
        flat["max_position_embeddings"] = extra["seq_length"]
    return flat


def measure(name: str, steps: int) -> dict:
    """Train `steps` steps of one shape on this process's device; estimate and measurements."""
    import torch

    from neox.config import derive, load_dict
    from neox.plan.memory import estimate_memory, training_shape
    from neox.training.loop import train_step
    from neox.training.setup import build_run

    cfg = load_dict(shape_config(name), source=f"shape {name}")
    run = build_run(cfg)
    on_gpu = run.device.type == "cuda"
    b, s = run.derived.micro_batch, cfg.model.seq_length
    g = torch.Generator().manual_seed(0)

    def stream():
        while True:
            yield {"text": torch.randint(0, VOCAB, (b, s + 1), generator=g)}

    batches = stream()
    for i in range(steps):
        metrics = train_step(run, batches, i).read()
    derived = derive(cfg, 1, VOCAB)
    shape = training_shape(cfg, derived, VOCAB, device=run.device.type)
    est = estimate_memory(cfg.model, shape)
    out = dict(
        shape=name,
        loss=metrics["loss"],
        estimate=est.as_dict(),
        device=str(run.device),
        assumed=f"{shape.engine} engine, {shape.loss} loss",
        engine_built=type(run.engine).__name__,
    )
    if on_gpu:
        out["max_allocated"] = torch.cuda.max_memory_allocated()
        out["max_reserved"] = torch.cuda.max_memory_reserved()
        out["gpu"] = torch.cuda.get_device_name()
    return out


def run_shape(name: str, steps: int) -> dict:
    """measure() in a fresh process, so each shape's peak starts from an empty GPU."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_PORT=str(port), MASTER_ADDR="127.0.0.1")
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    cmd = [sys.executable, __file__, "--measure", name, "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"shape {name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def format_table(results: list[dict]) -> str:
    gib = 1024**3
    lines = [
        f"{'shape':6} {'est alloc':>10} {'measured':>10} {'ratio':>6} "
        f"{'est reserved':>13} {'measured':>10} {'ratio':>6}  (GiB)  estimate assumed / built"
    ]
    for r in results:
        est = r["estimate"]
        alloc, reserved = r.get("max_allocated"), r.get("max_reserved")

        def cell(v):
            return f"{v / gib:10.2f}" if v is not None else f"{'n/a':>10}"

        def ratio(e, m):
            return f"{e / m:6.3f}" if m else f"{'n/a':>6}"

        lines.append(
            f"{r['shape']:6} {est['peak_allocated'] / gib:10.2f} {cell(alloc)} "
            f"{ratio(est['peak_allocated'], alloc)} {est['peak_reserved'] / gib:13.2f} "
            f"{cell(reserved)} {ratio(est['peak_reserved'], reserved)}         "
            f"{r['assumed']} / {r['engine_built']}"
        )
    device = results[0].get("gpu") or results[0]["device"]
    lines.append(f"device: {device}; loss after the last step: {results[-1]['loss']:.3f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="one tiny shape, on CPU when no GPU")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="shapes to run")
    p.add_argument("--steps", type=int, default=3, help="training steps per shape (default 3)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # the per-shape child process
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.steps)))
        return 0
    names = ["tiny"] if args.tiny else args.shapes or ["160M", "410M", "1.4B"]
    results = [run_shape(n, args.steps) for n in names]
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
