#!/usr/bin/env python
"""Estimate a training config's size, FLOPs, GPU memory and speed, without torch or a GPU.

    python tools/estimate.py configs/pythia/1-4B.yml configs/local_setup.yml --gpus 8
    python tools/estimate.py -d configs 20B.yml --gpus 64 --gpu a100 --mfu 0.35

Takes the same config arguments as deepy.py. Prints:
  parameters   total, non-embedding, and the most one tensor/pipeline-parallel rank holds
  FLOPs        training FLOPs per token, 6N + 12 L h s (as the MFU in the training logs)
  memory       per GPU for ZeRO stages 0-3 (the configured one starred), as the engine a GPU
               run of that stage uses allocates it (neox's flat engine or DeepSpeed 0.19's;
               a line names it per stage): weights, gradients, fp32 master weights,
               optimizer states, ZeRO buckets (ZeRO-3: gathered parameters), the optimizer
               step's fp32 gradients, activations saved for backward (flash or materialised
               attention, parallel residual, gated MLPs, GQA, tensor-parallel shards, pipeline
               micro-batches in flight; with and without activation checkpointing) and the
               loss over the logits (compiled, chunked or eager fp32); peak allocated
               (torch.cuda.max_memory_allocated), reserved (plus the caching allocator's
               slack) and total (plus the CUDA context).
               Under ZeRO-Offload (offload_optimizer/offload_param), the host memory per
               rank: fp32 masters and gradients, CPU Adam moments, offloaded parameters
               (pinned buffers rounded to powers of two); the GPU rows drop what moved.
  throughput   tokens/s of all GPUs at --mfu of --peak-tflops (default per --gpu).
Not included: NVMe offload's files (only its swap buffers), pipeline communication buffers, ALiBi/sliding-window masks
beyond one (heads, s, s) tensor per layer. docs/estimate.md lists the constants and sources.
"""

from __future__ import annotations

import argparse
import sys

from neox.config import ConfigError, derive, load_config
from neox.plan.preflight import tokenizer_vocab_size
from neox.plan.report import GPUS, estimate_report, estimate_vocab


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("configs", nargs="+", help="YAML/JSON config files, later ones override earlier")
    p.add_argument("-d", "--conf_dir", help="directory prefixed to every config name")
    p.add_argument(
        "--gpus",
        type=int,
        help="GPUs in the job (default: num_gpus x num_nodes from the config, else tp x pp)",
    )
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="GPU type (default h100)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default 0.4)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="peak dense bf16 TFLOPS per GPU (default by --gpu: "
        + ", ".join(f"{k} {v['peak_tflops']:g}" for k, v in GPUS.items())
        + ")",
    )
    return p.parse_args(argv)


def world_size(cfg, gpus: int | None) -> int:
    if gpus is not None:
        return gpus
    launcher, parallel = cfg.launcher, cfg.parallel
    if launcher.num_gpus is not None:
        return launcher.num_gpus * max(1, launcher.num_nodes)
    return parallel.model_parallel_size * parallel.pp


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not 0 < args.mfu <= 1:
        print(f"estimate.py: --mfu={args.mfu} must be in (0, 1], e.g. 0.4", file=sys.stderr)
        return 2
    if args.gpus is not None and args.gpus < 1:
        print(f"estimate.py: --gpus={args.gpus} must be >= 1", file=sys.stderr)
        return 2
    try:
        loaded = load_config(args.configs, args.conf_dir)
        try:
            vocab = tokenizer_vocab_size(loaded)
        except (ConfigError, OSError, ValueError):
            vocab = None  # no tokenizer files here: estimate_vocab assumes a standard one
        derived = derive(loaded.config, world_size(loaded.config, args.gpus), vocab)
    except ConfigError as e:
        print(f"estimate.py: config error:\n{e}", file=sys.stderr)
        return 2
    padded, source = estimate_vocab(loaded.config, derived)
    if source != "tokenizer":
        print(f"vocabulary: {source}, padded to {padded}")
    print(estimate_report(loaded.config, derived, padded, args.gpu, args.mfu, args.peak_tflops))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
