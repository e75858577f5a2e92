#!/usr/bin/env python
"""Training throughput on one host's GPUs through the real launcher: `deepy.py train.py` per
run, each a short run whose metrics.jsonl is read back, printed as one table.

python benchmarks/train_multi_gpu.py --vocab-file data/20B_tokenizer.json   # on 2 GPUs
python benchmarks/train_multi_gpu.py --tiny --runs 1gpu dp2                  # CPU, 2 ranks
python benchmarks/train_multi_gpu.py --models 410M --runs 1gpu 1gpu_seed2 1gpu_fp8 \
    --data-prefix data/shakespeare_text_document --seq-length 512 --iters 300   # loss curves
python benchmarks/train_multi_gpu.py --plan 4gpu     # issue 34's 4-GPU speed table (4 GPUs)
python benchmarks/train_multi_gpu.py --plan 8gpu     # issue 10's 8-GPU targets (8 GPUs)
python benchmarks/train_multi_gpu.py --plan long-context   # issue 38's targets (4 GPUs)

Runs (configs/pythia/<M>.yml with bf16, no activation checkpointing, the micro batch below,
random tokens): one GPU with ZeRO-1; DP=2 with ZeRO-1 (and its ratio to one GPU: issue 11's
target is >= 1.9x); TP=2, without and with torch_compile; PP=2 (4 micro batches per step, so the pipeline has work to overlap);
DP=2 with ZeRO-3 (peak memory per GPU against DP=2 ZeRO-1). tokens/s is the mean of the logged
steps from --first to the last (the first steps compile and warm up); memory is rank 0's peak
allocated (ranks of one layout hold near-equal shares).

--plan 4gpu (issue 34): Pythia-1.4B one GPU and DP=4; Pythia-6.9B at TP2 x PP2 (8 micro
batches), TP2 x DP2, TP4, DP=4 with activation checkpointing (ZeRO-1) and DP=4 ZeRO-3, FP8 beside
bf16 at TP2 x DP2; configs/20B.yml cut to 12 layers at TP2 x PP2. --plan 8gpu (issue 10):
Pythia-6.9B at TP2 x PP2 x DP2, and configs/20B.yml unchanged (its own TP2 x PP4, fp16 and
activation checkpointing; only data, tokenizer and schedule set). --plan long-context (issue
38, context parallelism): Pythia-1.4B at seq 32k on one GPU and at CP=4 (micro batch 1 both;
per-GPU tokens/s target >= 0.9x one GPU's), at 128k tokens per sequence on CP=4 (MFU counting
causal attention, i.e. half of the 12 L h s term, >= 45%), and a Llama-3-8B shape at 32k at
TP2 x CP2 and at CP4. Their overlays are dry-run in tests/benchmarks/test_train_multi_gpu.py,
so a GPU call only has to run them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.timeline import rank_timelines, timeline_lines  # noqa: E402
from neox.data.indexed import IndexedDatasetBuilder  # noqa: E402

# Model -> micro batch per GPU (issue 11's one-GPU shapes; fits an 80 GB H100).
MICRO_BATCH = {"410M": 8, "1-4B": 4, "2-8B": 4, "6-9B": 4, "20B-12L": 2, "20B": 4}
MICRO_BATCH |= {"6-9B-8L": 4, "20B-4L": 4, "20B-8L": 2}
# Long context (issue 38): one sequence a micro batch.
MICRO_BATCH |= {"1-4B-32k": 1, "1-4B-128k": 1, "llama3-8B-32k": 1}
MICRO_BATCH |= {"1-4B-32k-keep": 1, "1-4B-128k-keep": 1}


def long_context(seq: int, **keys: Any) -> dict[str, Any]:
    """Keys for training at `seq` tokens: the loss a chunk of logits at a time (a 32k x 50k
    fp32 logit tensor alone is 6.5 GB)."""
    return {"seq_length": seq, "max_position_embeddings": seq, "lm_loss_chunk_size": 4096, **keys}


# Model -> (config file, keys over it): the Pythia files, and configs/20B.yml whole or cut.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    m: (f"configs/pythia/{m}.yml", {}) for m in ("410M", "1-4B", "2-8B", "6-9B")
} | {"20B-12L": ("configs/20B.yml", {"num_layers": 12}), "20B": ("configs/20B.yml", {})}
# TP = PP = 1: the DP runs' layout (configs/pythia/6-9B.yml and configs/20B.yml set TP and PP).
DP_ONLY = {"model_parallel_size": 1, "pipe_parallel_size": 1}
# One-GPU slices at full width (layers cut to fit weights and Adam states in one GPU): what a
# block of each shape runs at with no parallelism at all, the ceiling of its 4-GPU layouts;
# 20B-8L has 4 blocks a stage at PP=2 (the 12-layer cut has 6).
MODELS |= {
    "6-9B-8L": (
        "configs/pythia/6-9B.yml",
        {"num_layers": 8, "attention_config": [[["flash"], 8]], **DP_ONLY},
    ),
    "20B-4L": ("configs/20B.yml", {"num_layers": 4, **DP_ONLY}),
    "20B-8L": ("configs/20B.yml", {"num_layers": 8, **DP_ONLY}),
}
MODELS |= {
    # One H200 trains 1.4B at 32k with these (README, "Long context"); CP=4 gets the same keys.
    "1-4B-32k": ("configs/pythia/1-4B.yml", long_context(32768, activation_memory_budget=0.75)),
    # 32k tokens a rank at CP=4: the one-GPU 32k run's activations, attention over 128k.
    "1-4B-128k": ("configs/pythia/1-4B.yml", long_context(131072, activation_memory_budget=0.75)),
    # Every activation kept (no recompute): CP=4 leaves the memory for it, and an H200 holds
    # the one-GPU 32k run too.
    "1-4B-32k-keep": ("configs/pythia/1-4B.yml", long_context(32768)),
    "1-4B-128k-keep": ("configs/pythia/1-4B.yml", long_context(131072)),
    # 8B's weights, gradients and Adam states (ZeRO-1 over the context-parallel ranks) leave no
    # room for 8k-16k tokens of activations a rank without recomputation.
    "llama3-8B-32k": (
        "configs/llama3/8B.yml",
        long_context(
            32768,
            max_position_embeddings=131072,
            checkpoint_activations=True,
            zero_optimization={"stage": 1},
        ),
    ),
}

FP8_ALL = {
    "enabled": True,
    "skip_first_layers": 0,
    "skip_last_layers": 0,
    "output_layer": True,
    "fast_accum_backward": True,
}

# Each sequence over 4 ranks (issue 38), the base of the cp4 runs.
CP4 = {"num_gpus": 4, **DP_ONLY, "context_parallel_size": 4}
CP2 = {"num_gpus": 2, **DP_ONLY, "context_parallel_size": 2}
# TP2 x PP2 at 8 micro batches a step, the base of the tp2_pp2 runs.
TP2_PP2 = {
    "num_gpus": 4,
    "model_parallel_size": 2,
    "pipe_parallel_size": 2,
    "gradient_accumulation_steps": 8,
}
# DeepSpeed's throughput timer off (its start and stop synchronise the device).
UNTIMED = {"deepspeed_extra_args": {"timers": {"throughput": {"enabled": False}}}}
# Run name -> config keys on top of the model's file and OVERLAY.
RUNS: dict[str, dict[str, Any]] = {
    "1gpu": {"num_gpus": 1},
    "dp2": {"num_gpus": 2},
    # Eager TP, the baseline of tp2_compile (torch_compile is on by default under TP since
    # 2026-11-26: tp2_compile is what neox runs).
    "tp2": {"num_gpus": 2, "model_parallel_size": 2, "torch_compile": False},
    "tp2_compile": {"num_gpus": 2, "model_parallel_size": 2, "torch_compile": True},
    "tp2_sp_compile": {
        "num_gpus": 2,
        "model_parallel_size": 2,
        "torch_compile": True,
        "sequence_parallel": True,
    },
    # Loss diagnosis beside tp2_compile: the traced graphs run by aot_eager (no generated code).
    "tp2_compile_aot_eager": {
        "num_gpus": 2,
        "model_parallel_size": 2,
        "torch_compile": True,
        "torch_compile_backend": "aot_eager",
    },
    "pp2": {"num_gpus": 2, "pipe_parallel_size": 2, "gradient_accumulation_steps": 4},
    # 20B's layout costs one at a time (issue 34): PP=2 alone and TP=2 alone against one GPU, at
    # the 33.5% run's micro batch 2 x 8 (`multi_gpu.sh split20b`).
    "pp2_accum8": {"num_gpus": 2, "pipe_parallel_size": 2, "gradient_accumulation_steps": 8},
    "tp2_accum8": {"num_gpus": 2, "model_parallel_size": 2, "gradient_accumulation_steps": 8},
    "dp2_zero3": {"num_gpus": 2, "zero_optimization": {"stage": 3}},
    # The same at 8 micro batches a step, where ZeRO-3's per-micro-batch work hides behind
    # longer micro batches (one rank: 0.93x the flat engine at micro batch 8 x 8).
    "dp2_accum8": {"num_gpus": 2, "gradient_accumulation_steps": 8},
    "dp2_zero3_accum8": {
        "num_gpus": 2,
        "zero_optimization": {"stage": 3},
        "gradient_accumulation_steps": 8,
    },
    # One GPU through deepy: FP8, a second bf16 seed (the loss noise band beside FP8's) and
    # ZeRO-3 with the optimizer and parameters offloaded to the host (DeepSpeed's CPU Adam).
    "1gpu_seed2": {"num_gpus": 1, "seed": 4321},
    "1gpu_fp8": {"num_gpus": 1, "fp8": {"enabled": True}},
    # The optimizer step amortised over 8 micro batches (Pythia-1.4B's own batch is 1,024
    # sequences: 256 micro batches of 4 on one GPU).
    "1gpu_accum8": {"num_gpus": 1, "gradient_accumulation_steps": 8},
    # FP8 as dp4_accum8_fp8 runs it, on one GPU (a slice's block-level ratio to bf16).
    "1gpu_accum8_fp8": {"num_gpus": 1, "gradient_accumulation_steps": 8, "fp8": FP8_ALL},
    "1gpu_eager": {"num_gpus": 1, "torch_compile": False},
    # DeepSpeed's engine at one GPU (TP=1, ZeRO-1) in place of the flat engine, compiled blocks.
    "1gpu_ds_engine": {"num_gpus": 1, "flat_engine": False},
    "1gpu_ds_engine_accum8": {
        "num_gpus": 1,
        "flat_engine": False,
        "gradient_accumulation_steps": 8,
    },
    # ZeRO-3 at one rank (neox's ZeRO-3 defaults) beside 1gpu and 1gpu_accum8: speed and losses.
    "1gpu_zero3": {"num_gpus": 1, "zero_optimization": {"stage": 3}},
    "1gpu_zero3_accum8": {
        "num_gpus": 1,
        "zero_optimization": {"stage": 3},
        "gradient_accumulation_steps": 8,
    },
    # Four GPUs (issue 34). Pipelines get 8 micro batches a step so the bubble is 1/9 of it
    # (1F1B: (pp - 1) / (m + pp - 1) at pp=2).
    # DP runs name TP=1: configs/pythia/6-9B.yml sets model_parallel_size 2.
    "dp4": {"num_gpus": 4, **DP_ONLY},
    "dp4_ckpt": {"num_gpus": 4, **DP_ONLY, "checkpoint_activations": True},
    "dp4_zero3": {"num_gpus": 4, **DP_ONLY, "zero_optimization": {"stage": 3}},
    "dp4_zero3_ckpt": {
        "num_gpus": 4,
        **DP_ONLY,
        "zero_optimization": {"stage": 3},
        "checkpoint_activations": True,
    },
    "tp2_pp2": TP2_PP2,
    # Without recompute at a step of 16 sequences a GPU: DP=4 at micro batch 2 (69 GiB by the
    # estimate at 6.9B: an H100 holds it), ZeRO-3 at 4 (72 GiB), and TP2 x PP2 at micro batch 4 x 16
    # (the bubble 1/17 of the step, 38 GiB at 20B-12L). Each leaves the per-step work (gradient
    # reduction, optimizer) to 4x the tokens of a 4 x 1 step.
    "dp4_accum8": {
        "num_gpus": 4,
        **DP_ONLY,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 8,
    },
    "dp4_zero3_accum4": {
        "num_gpus": 4,
        **DP_ONLY,
        "zero_optimization": {"stage": 3},
        "gradient_accumulation_steps": 4,
    },
    # DeepSpeed's pipeline sends whole activations and gradients instead of a 1/tp slice each
    # that the next stage all-gathers (its pipe_partitioned / grad_partitioned, on by default
    # under TP): no all-gather and no host sync of the slice's metadata a micro batch.
    "tp2_pp2_whole_sends": {
        **TP2_PP2,
        "deepspeed_extra_args": {
            "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}
        },
    },
    # ZeRO-3 at a step of 16 sequences a GPU as 8 x 2: its per-micro-batch gathers and
    # reduce-scatter paid twice a step instead of 4 times (~100 GiB by the estimate: an H200).
    "dp4_zero3_mb8": {
        "num_gpus": 4,
        **DP_ONLY,
        "zero_optimization": {"stage": 3},
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
    },
    "tp2_pp2_accum16": {
        **TP2_PP2,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 16,
    },
    "tp2_dp2": {"num_gpus": 4, "model_parallel_size": 2},
    # Sequence parallelism beside tp2_dp2 (issue 34): the same bytes as reduce-scatters and
    # all-gathers, norms and dropout on half the tokens.
    "tp2_dp2_sp": {"num_gpus": 4, "model_parallel_size": 2, "sequence_parallel": True},
    "tp2_dp2_ckpt": {"num_gpus": 4, "model_parallel_size": 2, "checkpoint_activations": True},
    "tp4": {"num_gpus": 4, "model_parallel_size": 4},
    # FP8 at its fastest one-GPU setting (every block, the output layer, fast backward).
    "tp2_dp2_fp8": {
        "num_gpus": 4,
        "model_parallel_size": 2,
        "fp8": FP8_ALL,
    },
    "dp4_ckpt_fp8": {"num_gpus": 4, **DP_ONLY, "checkpoint_activations": True, "fp8": FP8_ALL},
    # FP8 at the layout predicted fastest in bf16 (whole-width GEMMs, one reduction a step).
    "dp4_accum8_fp8": {
        "num_gpus": 4,
        **DP_ONLY,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 8,
        "fp8": FP8_ALL,
    },
    # Context parallelism (issue 38): each sequence over 4 ranks, or 2 beside TP=2.
    "cp4": CP4,
    "cp2": CP2,  # the exchange on 2 GPUs
    # cp4_chunks* on a 2-GPU kind: 8 heads a rank in 2 or 4 groups (multi_gpu.sh cp-chunks2).
    "cp2_chunks2": {**CP2, "context_parallel_chunks": 2},
    "cp2_chunks4": {**CP2, "context_parallel_chunks": 4},
    # The flat engine's gradient reduction (issues 34, 38): dp4 and cp4 take the Pythia file's
    # overlap_comm: true (buckets of 500M elements during the backward); beside them, the
    # reduce-scatter after the backward and buckets of 50M elements.
    "dp4_no_overlap": {"num_gpus": 4, **DP_ONLY, "zero_optimization": {"overlap_comm": False}},
    "dp4_bucket50m": {
        "num_gpus": 4,
        **DP_ONLY,
        "zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 50_000_000},
    },
    "cp4_no_overlap": {**CP4, "zero_optimization": {"overlap_comm": False}},
    "cp4_bucket50m": {
        **CP4,
        "zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 50_000_000},
    },
    # CP's exchange in head groups that overlap the attention kernel (issue 38): 2 or 4 groups
    # of 1.4B's 4 heads a rank, against cp4's one exchange each way.
    "cp4_chunks2": {**CP4, "context_parallel_chunks": 2},
    "cp4_chunks4": {**CP4, "context_parallel_chunks": 4},
    # 8 micro batches a step (issue 38): the gradient reduction and the optimizer step, which
    # cp4 pays for every 32k-token sequence, paid once per 8; beside 1gpu_accum8.
    "cp4_accum8": {**CP4, "gradient_accumulation_steps": 8},
    "cp4_chunks2_accum8": {**CP4, "context_parallel_chunks": 2, "gradient_accumulation_steps": 8},
    "tp2_cp2": {
        "num_gpus": 4,
        "model_parallel_size": 2,
        "pipe_parallel_size": 1,
        "context_parallel_size": 2,
        "lm_loss_chunk_size": 0,  # TP's vocab-parallel loss takes its place
    },
    # Eight GPUs (issue 10).
    "tp2_pp2_dp2": {
        "num_gpus": 8,
        "model_parallel_size": 2,
        "pipe_parallel_size": 2,
        "gradient_accumulation_steps": 8,
    },
    # The config file's own layout and keys: only data, tokenizer, schedule and logging set.
    "stock8": {"num_gpus": 8},
    "1gpu_zero3_offload": {
        "num_gpus": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
        "checkpoint_activations": True,
    },
}
# speed3's 6.9B runs on a 2-GPU kind (multi_gpu.sh speed-2gpu): each GPU's work as at DP=4, the
# gradient reduction and ZeRO-3's gathers over 2 ranks (ZeRO-3 at 8 x 2 would take ~140 GiB
# there: half the shards of DP=4).
for four, two in (
    ("dp4_accum8", "dp2_mb2_accum8"),
    ("dp4_accum8_fp8", "dp2_mb2_accum8_fp8"),
    ("dp4_zero3_accum4", "dp2_zero3_accum4"),
):
    RUNS[two] = {**RUNS[four], "num_gpus": 2}
# The config file's own precision, activation checkpointing and per-layer sync (MODEL_KEYS, which
# OVERLAY otherwise replaces) at the run's layout and batch: configs/20B.yml's fp16, recompute and
# synchronize_each_layer, as issue 34's 33.5% run had them (`multi_gpu.sh keys20b`); beside them,
# recompute alone and recompute with the sync, in OVERLAY's bf16.
KEY_SUFFIXES = ("", "_ckpt", "_ckpt_sync", "_file")
KEY_BASES = ("1gpu_ds_engine_accum8", "tp2_pp2")
FILE_KEY_RUNS = tuple(f"{base}_file" for base in KEY_BASES)
for base in KEY_BASES:
    RUNS[f"{base}_ckpt"] = {**RUNS[base], "checkpoint_activations": True}
    RUNS[f"{base}_ckpt_sync"] = {**RUNS[f"{base}_ckpt"], "synchronize_each_layer": True}
    RUNS[f"{base}_file"] = RUNS[base]
# DeepSpeed's engine and ZeRO-3 at one rank without DeepSpeed's throughput timer, which
# synchronises the device at every forward and every engine.step() (neox passes no dataloader
# to deepspeed.initialize).
UNTIMED_RUNS = tuple(
    f"{r}_untimed"
    for r in ("1gpu_ds_engine", "1gpu_ds_engine_accum8", "1gpu_zero3", "1gpu_zero3_accum8")
)
RUNS |= {name: {**RUNS[name.removesuffix("_untimed")], **UNTIMED} for name in UNTIMED_RUNS}
ONE_GPU_EXTRA = (
    "1gpu_seed2",
    "1gpu_fp8",
    "1gpu_accum8",
    "1gpu_accum8_fp8",
    "1gpu_eager",
    "1gpu_zero3",
    "1gpu_zero3_accum8",
    "1gpu_zero3_offload",
    *UNTIMED_RUNS,
    *(f"1gpu_ds_engine_accum8{s}" for s in KEY_SUFFIXES[1:]),
)
TWO_GPU_EXTRA = ("dp2_zero3", "dp2_accum8", "dp2_zero3_accum8", "tp2_sp_compile")
TWO_GPU_EXTRA += (
    "pp2_accum8",
    "tp2_accum8",
    "dp2_mb2_accum8",
    "dp2_mb2_accum8_fp8",
    "dp2_zero3_accum4",
)
DIAGNOSTIC = ("tp2_compile_aot_eager",)
# Issue 34's 4-GPU table and issue 10's 8-GPU targets, in order (--plan 4gpu / 8gpu).
PLANS = {
    "4gpu": [
        ("1-4B", "1gpu"),
        ("1-4B", "dp4"),
        ("6-9B", "tp2_pp2"),
        ("6-9B", "tp2_dp2"),
        ("6-9B", "tp4"),
        ("6-9B", "dp4_ckpt"),
        ("6-9B", "dp4_zero3_ckpt"),
        ("6-9B", "tp2_dp2_fp8"),
        ("20B-12L", "tp2_pp2"),
        ("6-9B", "dp4_accum8"),
        ("6-9B", "dp4_accum8_fp8"),
        ("6-9B", "dp4_zero3_accum4"),
        ("20B-12L", "tp2_pp2_accum16"),
    ],
    "8gpu": [("6-9B", "tp2_pp2_dp2"), ("20B", "stock8")],
    "long-context": [
        ("1-4B-32k", "1gpu"),
        ("1-4B-32k", "cp4"),
        ("1-4B-128k", "cp4"),
        ("llama3-8B-32k", "tp2_cp2"),
        ("llama3-8B-32k", "cp4"),
    ],
    # overlap_comm's A/B (run as two commands: multi_gpu.sh overlap-dp, overlap-cp).
    "overlap": [
        *[("1-4B", r) for r in ("1gpu", "dp4_no_overlap", "dp4", "dp4_bucket50m")],
        *[("1-4B-32k-keep", r) for r in ("1gpu", "cp4_no_overlap", "cp4", "cp4_bucket50m")],
    ],
    # context_parallel_chunks' A/B (multi_gpu.sh cp-chunks).
    "cp-chunks": [("1-4B-32k-keep", r) for r in ("1gpu", "cp4", "cp4_chunks2", "cp4_chunks4")],
    "split20b": [("20B-8L", r) for r in ("1gpu_accum8", "pp2_accum8", "tp2_accum8")],
    # configs/20B.yml's own keys against the benchmark's (multi_gpu.sh keys20b): on one GPU at
    # 4 layers, and at 12 layers TP2 x PP2 as in issue 34's 33.5% run.
    "keys20b-1gpu": [("20B-4L", f"1gpu_ds_engine_accum8{s}") for s in KEY_SUFFIXES],
    "keys20b": [("20B-12L", f"tp2_pp2{s}") for s in KEY_SUFFIXES],
    # The pipeline's partitioned sends against whole ones at 20B-12L (multi_gpu.sh pipe-sends).
    "pipe-sends": [("20B-12L", r) for r in ("tp2_pp2", "tp2_pp2_whole_sends")],
    # ZeRO-3 at micro batch 8 x 2 beside 4 x 4 (multi_gpu.sh zero3-mb8; an H200's memory).
    "zero3-mb8": [("6-9B", r) for r in ("dp4_accum8", "dp4_zero3_accum4", "dp4_zero3_mb8")],
    # speed3's 6.9B runs and cp-chunks at half the ranks, for a 2-GPU kind (multi_gpu.sh
    # speed-2gpu, cp-chunks2): the per-GPU work of the 4-GPU runs, the collectives over 2.
    "speed-2gpu": [
        ("6-9B", r) for r in ("dp2_mb2_accum8", "dp2_mb2_accum8_fp8", "dp2_zero3_accum4")
    ],
    "cp-chunks2": [("1-4B-32k-keep", r) for r in ("1gpu", "cp2", "cp2_chunks2", "cp2_chunks4")],
    "cp-accum": [("1-4B-32k-keep", r) for r in ("1gpu_accum8", "cp4_accum8", "cp4_chunks2_accum8")],
    # Without recompute where the memory allows it (CP=4 always; one GPU on an H200, not an
    # H100: this plan is not in the H100 fit test).
    "long-context-keep": [
        ("1-4B-32k", "1gpu"),
        ("1-4B-32k-keep", "1gpu"),
        ("1-4B-32k-keep", "cp4"),
        ("1-4B-128k-keep", "cp4"),
    ],
}
FOUR_GPU_EXTRA = tuple(
    r for r in RUNS if r.startswith(("dp4", "tp2_pp2", "tp2_dp2", "tp4", "cp", "tp2_cp2"))
)
# Keys of OVERLAY that change the model or its training, which "stock" runs leave to the file.
MODEL_KEYS = (*common.OVERLAY, "synchronize_each_layer", "wall_clock_breakdown")
STOCK = ("stock8",)
# Run only when named, but for dp2_zero3 at 1.4B in the default plan.
EXTRA = ONE_GPU_EXTRA + TWO_GPU_EXTRA + DIAGNOSTIC + FOUR_GPU_EXTRA + ("stock8",)
# (model, run) in order; ZeRO-3 only where the issue asks for its memory (1.4B).
DEFAULT_PLAN = [
    (m, r)
    for m in ("410M", "1-4B")
    for r in RUNS
    if r not in EXTRA or (r == "dp2_zero3" and m == "1-4B")
]

OVERLAY: dict[str, Any] = {
    **common.OVERLAY,
    "synchronize_each_layer": False,
    "wall_clock_breakdown": False,
    "gradient_accumulation_steps": 1,
    "checkpoint_factor": None,
    "extra_save_iters": None,
    "split": "100,0,0",
    "eval_iters": 0,
    "do_test": False,
    "log_interval": 1,
    "num_workers": 1,
}

TINY: dict[str, Any] = {**common.TINY, "num_workers": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_random_tokens(prefix: Path, vocab: int, tokens: int, seed: int = 0) -> None:
    """A .bin/.idx dataset of uniformly random ids in documents of 8192 tokens."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for _ in range(-(-tokens // 8192)):
        builder.add_item(rng.integers(0, vocab, 8192, dtype=np.uint16))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def run_config(args, model: str, run: str, work: Path, data: Path) -> Path:
    """The overlay file of one run under `work`."""
    cfg = {**OVERLAY, "train_micro_batch_size_per_gpu": args.micro_batch or MICRO_BATCH[model]}
    if run in STOCK + FILE_KEY_RUNS:  # the file's own precision, checkpointing and timers
        micro = cfg["train_micro_batch_size_per_gpu"]
        cfg = {k: v for k, v in OVERLAY.items() if k not in MODEL_KEYS or k in ("save", "load")}
        cfg["tensorboard_dir"] = None
        if run in STOCK:  # and its batch
            cfg.pop("gradient_accumulation_steps")
        else:
            cfg["train_micro_batch_size_per_gpu"] = micro
    cfg |= {"train_iters": args.iters, "lr_decay_iters": args.iters, "data_path": str(data)}
    cfg |= {"log_dir": str(work / f"{model}_{run}"), "master_port": free_port()}
    if args.vocab_file:
        cfg["vocab_file"] = args.vocab_file
    if args.seq_length:
        cfg |= {"seq_length": args.seq_length, "max_position_embeddings": args.seq_length}
    cfg |= MODELS[model][1]
    if getattr(args, "profile", False):  # torch.profiler over the last two steps, every rank
        cfg |= {"profile": True, "profile_step_start": args.iters - 1}
        cfg["profile_step_stop"] = args.iters
    if args.tiny:
        cfg |= TINY
    cfg |= RUNS[run]
    if args.tiny and "fp8" in cfg:
        cfg.pop("fp8")  # no float8 matmuls on CPU ranks: the smoke run keeps the row
    if "zero_optimization" in RUNS[run]:
        # Stage 3 keeps the file's other ZeRO settings; the keys are merged over it.
        base = yaml.safe_load((ROOT / MODELS[model][0]).read_text())
        cfg["zero_optimization"] = {
            **base.get("zero_optimization", {}),
            **RUNS[run]["zero_optimization"],
        }
    path = work / f"{model}_{run}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(args, config: Path, overlay: Path, log: Path) -> tuple[int, float, int]:
    """`deepy.py train.py <config> <overlay>`, output to `log`; (exit code, seconds, peak host
    memory of the launch's processes)."""
    cmd = [sys.executable, str(ROOT / "deepy.py"), "train.py", str(config), str(overlay)]
    env = common.child_env()
    if args.tiny:
        env["DS_ACCELERATOR"] = "cpu"
    tick = time.perf_counter()
    peak = 0
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            if time.perf_counter() - tick > args.timeout:
                proc.kill()
                proc.wait()
                return 124, time.perf_counter() - tick, peak
            time.sleep(0.5)
    return proc.returncode, time.perf_counter() - tick, peak


def tree_rss(root: int) -> int:
    """Resident host memory of `root` and all its descendants (Linux /proc), bytes."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            parents[int(entry)] = int(stat[1])
            rss[int(entry)] = int(stat[21]) * page
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(children)
        frontier += children
    return sum(rss.get(pid, 0) for pid in tree)


def logged_steps(metrics: Path) -> int:
    """The last train step a run's metrics.jsonl logged (0: none)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return max((r["step"] for r in records if r.get("split") == "train"), default=0)


def summarize(metrics_file: Path, first: int, last: int | None = None) -> dict[str, Any]:
    """Mean speed of the train records of steps `first` to `last` (default: the end), and the
    peak memory logged."""
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    train = [
        r
        for r in records
        if r.get("split") == "train" and first <= r["step"] <= (last or r["step"])
    ]
    if not train:
        raise ValueError(f"{metrics_file} has no train records from step {first}")
    mean = lambda key: sum(r[key] for r in train) / len(train)  # noqa: E731
    out = {"steps": f"{train[0]['step']}-{train[-1]['step']}", "tokens_per_s": mean("tokens_per_s")}
    out["step_ms"] = 1000 * mean("step_time_s")
    out["tflops_per_gpu"] = mean("tflops_per_gpu") if "tflops_per_gpu" in train[0] else None
    out["mfu"] = mean("mfu") if "mfu" in train[0] else None
    peaks = [r.get("mem_peak_allocated_gb", r.get("rss_gb")) for r in train]
    out["peak_mem_gb"] = max(peaks) if None not in peaks else None
    # The loss curve of every logged step, and the mean of its last tenth (the noise band of
    # two seeds is read from these).
    every = [r for r in records if r.get("split") == "train"]
    out["losses"] = [round(r["loss"], 4) for r in every]
    tail = out["losses"][-max(1, len(every) // 10) :]
    out["loss_tail_mean"] = sum(tail) / len(tail)
    return out


def timed_last(args) -> Optional[int]:
    """The last step averaged: the end, or under --profile the step before the two profiled
    ones (the profiler slows them), where steps from --first remain."""
    if getattr(args, "profile", False) and args.iters - 2 >= args.first:
        return args.iters - 2
    return None


def measure(args, model: str, run: str, work: Path, data: Path) -> dict[str, Any]:
    overlay = run_config(args, model, run, work, data)
    log = work / f"{model}_{run}.log"
    code, seconds, host_peak = launch(args, ROOT / MODELS[model][0], overlay, log)
    rec: dict[str, Any] = {"model": model, "run": run, "exit_code": code, "wall_s": seconds}
    rec["host_peak_rss_gb"] = host_peak / 2**30  # every process of the launch, summed
    rec |= {"micro_batch": args.micro_batch or MICRO_BATCH[model], "config": RUNS[run]}
    metrics = work / f"{model}_{run}" / "metrics.jsonl"
    if metrics.is_file() and logged_steps(metrics) >= args.iters:
        rec |= summarize(metrics, args.first, timed_last(args))
        if code != 0:  # e.g. the time limit reached while the profiler wrote its traces
            rec["ended_after_timed_steps"] = True
    else:
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.is_file() else []
        rec["error"] = "\n".join(tail)
    if getattr(args, "profile", False):  # each rank's device time: busy, exposed comm, idle
        rec["timeline"] = rank_timelines(work / f"{model}_{run}" / "profile")
    return rec


def print_table(records: list[dict[str, Any]]) -> None:
    print(
        f"{'model':>6} {'run':>11} {'tok/s':>9} {'x 1gpu':>7} {'ms/step':>8} {'TFLOPS/gpu':>10} "
        f"{'MFU':>6} {'peak GB':>8} {'wall s':>7}"
    )
    one = {
        r["model"]: r["tokens_per_s"] for r in records if r["run"] == "1gpu" and "tokens_per_s" in r
    }
    for r in records:
        if "tokens_per_s" not in r:
            print(f"{r['model']:>6} {r['run']:>11} failed (exit {r['exit_code']}), see its log")
            continue
        ratio = f"{r['tokens_per_s'] / one[r['model']]:.2f}x" if r["model"] in one else "-"
        tflops = f"{r['tflops_per_gpu']:.1f}" if r["tflops_per_gpu"] is not None else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gb']:.2f}" if r["peak_mem_gb"] is not None else "-"
        print(
            f"{r['model']} {r['run']}: loss {r['losses'][0]:.3f} -> tail mean {r['loss_tail_mean']:.4f}; host peak {r['host_peak_rss_gb']:.1f} GB"
        )
        print(
            f"{r['model']:>6} {r['run']:>11} {r['tokens_per_s']:>9.0f} {ratio:>7} "
            f"{r['step_ms']:>8.1f} {tflops:>10} {mfu:>6} {mem:>8} {r['wall_s']:>7.0f}"
        )
    by = {(r["model"], r["run"]): r for r in records if "tokens_per_s" in r}
    for model in dict.fromkeys(r["model"] for r in records):
        if (model, "dp2") in by and (model, "1gpu") in by:
            ratio = by[(model, "dp2")]["tokens_per_s"] / by[(model, "1gpu")]["tokens_per_s"]
            print(f"{model}: DP=2 ZeRO-1 / one GPU = {ratio:.2f}x (target >= 1.9x)")
        zero1, zero3 = by.get((model, "dp2")), by.get((model, "dp2_zero3"))
        if zero1 and zero3 and zero1["peak_mem_gb"] and zero3["peak_mem_gb"]:
            print(
                f"{model}: peak memory per GPU, DP=2 ZeRO-3 {zero3['peak_mem_gb']:.2f} GB vs "
                f"ZeRO-1 {zero1['peak_mem_gb']:.2f} GB"
            )
    for line in targets(by):
        print(line)
    for r in records:
        for line in timeline_lines(f"{r['model']} {r['run']}", r.get("timeline", {})):
            print(line)


def targets(by: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """Issue 34's and issue 10's speed targets, for the runs present."""
    tps = lambda m, r: by[(m, r)]["tokens_per_s"] if (m, r) in by else None  # noqa: E731
    out = []
    for dp4 in ("dp4_no_overlap", "dp4", "dp4_bucket50m"):  # the last two: overlap_comm
        if tps("1-4B", dp4) and tps("1-4B", "1gpu"):
            ratio = tps("1-4B", dp4) / tps("1-4B", "1gpu")
            name = "DP=4" + (f" ({dp4})" if dp4 != "dp4" else "")
            out.append(f"1-4B: {name} / one GPU = {ratio:.2f}x (target >= 3.85x)")
    mfu = {r: by[("6-9B", r)]["mfu"] for m, r in by if m == "6-9B" and by[(m, r)]["mfu"]}
    four = {r: v for r, v in mfu.items() if RUNS[r]["num_gpus"] == 4 and "fp8" not in RUNS[r]}
    if four:
        best = max(four, key=four.get)
        out.append(f"6-9B: best 4-GPU layout {best} at {four[best]:.1%} MFU (target >= 52%)")
        zero1 = {r: tps("6-9B", r) for r in four if "zero3" not in r}
        zero3 = {r: tps("6-9B", r) for r in four if "zero3" in r}
        if zero1 and zero3:
            b1, b3 = max(zero1, key=zero1.get), max(zero3, key=zero3.get)
            ratio = zero3[b3] / zero1[b1]
            out.append(f"6-9B: ZeRO-3 {b3} / best ZeRO-1 {b1} = {ratio:.2f}x (target >= 0.9x)")
    for fp8 in (r for m, r in by if m == "6-9B" and "fp8" in RUNS[r]):
        base = fp8.removesuffix("_fp8")
        if tps("6-9B", base):
            ratio = tps("6-9B", fp8) / tps("6-9B", base)
            out.append(f"6-9B: FP8 {fp8} / bf16 {base} = {ratio:.2f}x (target >= 1.25x)")
    mfu20 = {
        r: by[(m, r)]["mfu"]
        for m, r in by
        if m == "20B-12L" and r.startswith("tp2_pp2") and by[(m, r)]["mfu"]
    }
    if mfu20:
        best = max(mfu20, key=mfu20.get)
        out.append(f"20B at 12 layers: TP2 x PP2 ({best}) at {mfu20[best]:.1%} MFU (target >= 45%)")
    if ("6-9B", "tp2_pp2_dp2") in by and by[("6-9B", "tp2_pp2_dp2")]["mfu"]:
        mfu8 = by[("6-9B", "tp2_pp2_dp2")]["mfu"]
        out.append(f"6-9B: TP2 x PP2 x DP2 on 8 GPUs at {mfu8:.1%} MFU (target >= 45%)")
    return out + long_context_targets(by)


def long_context_targets(by: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """Issue 38's targets, for the runs present: per-GPU tokens/s of CP=4 against one GPU at
    32k, and MFU counting causal attention (metrics' `mfu` counts every key: 12 L h s)."""
    out = []
    ones = {m: r for (m, run), r in by.items() if m.startswith("1-4B-32k") and run == "1gpu"}
    for (model, run), cp in by.items():
        if model.startswith("1-4B-32k") and run.startswith(("cp2", "cp4")):
            n = int(run[2])
            for base, one in ones.items():
                ratio = cp["tokens_per_s"] / n / one["tokens_per_s"]
                goal = " (target >= 0.9x)" if n == 4 else ""
                name = f"CP={n}" + run[3:].replace("_", " ")  # cp4_no_overlap: "CP=4 no overlap"
                out.append(f"{model} {name} per-GPU tokens/s / {base} one GPU = {ratio:.2f}x{goal}")
    for model, run in by:
        if model.startswith(("1-4B-128k", "llama3-8B-32k")) and by[(model, run)]["mfu"]:
            mfu = by[(model, run)]["mfu"] * causal_share(model)
            goal = " (target >= 45%)" if model.startswith("1-4B-128k") else ""
            out.append(f"{model} {run}: MFU counting causal attention {mfu:.1%}{goal}")
    return out


def causal_share(model: str) -> float:
    """(6N + 6 L h s) / (6N + 12 L h s) of `model`: the share of logged MFU that remains when
    attention counts only the keys a causal query sees (half of them, on average)."""
    from neox.config import load_config
    from neox.plan.estimate import flops_parameters, train_flops_per_token

    path, keys = MODELS[model]
    cfg = load_config([str(ROOT / path)]).config.model
    cfg = cfg.model_copy(update={k: keys[k] for k in ("seq_length", "max_position_embeddings")})
    vocab = 50304  # within a fraction of a percent of any padded vocabulary here
    full = train_flops_per_token(cfg, vocab)
    dense = 6 * flops_parameters(cfg, vocab)
    return (dense + (full - dense) / 2) / full


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MICRO_BATCH), default=None)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=None)
    p.add_argument("--plan", choices=list(PLANS), default=None, help="a whole table, in order")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--first", type=int, default=10, help="first logged step averaged")
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--vocab-file", default="data/20B_tokenizer.json")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--work-dir", default=None, help="keep configs, logs and metrics here")
    p.add_argument("--json", default=None, help="append one JSON record per run here")
    p.add_argument("--tiny", action="store_true", help="2-layer model on 2 CPU ranks: a smoke test")
    p.add_argument(
        "--data-prefix",
        default=None,
        help="train on this .bin/.idx dataset (real text, for loss curves) instead of random tokens",
    )
    p.add_argument("--seq-length", type=int, default=None, help="override seq_length")
    p.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler over the last two steps: <work>/<model>_<run>/profile/rank*.ops.txt",
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.iters, args.first, args.vocab_file = min(args.iters, 6), min(args.first, 3), None
    elif not (ROOT / args.vocab_file).is_file() and not Path(args.vocab_file).is_file():
        p.error(
            f"--vocab-file {args.vocab_file} not found: pass the GPT-NeoX-20B tokenizer json "
            "(shared/data/20B_tokenizer.json), which sets the vocabulary Pythia trains with"
        )
    plan = [
        (m, r)
        for m, r in PLANS.get(args.plan, DEFAULT_PLAN)
        if (args.models is None or m in args.models) and (args.runs is None or r in args.runs)
    ]
    if args.models and args.runs and not args.plan:
        # Both named: every model under every run (a plan of its own).
        plan = [(m, r) for m in args.models for r in args.runs]
    for extra in EXTRA if not args.plan else ():
        if args.runs and extra in args.runs:
            plan += [(m, extra) for m in args.models or MICRO_BATCH if (m, extra) not in plan]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="neox_multi_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data_prefix) if args.data_prefix else work / "random_tokens"
    batch = max(MICRO_BATCH.values()) if args.micro_batch is None else args.micro_batch
    seq = 64 if args.tiny else args.seq_length or 2048
    # Enough for the largest step (configs/20B.yml's own: 32 micro batches) over every iteration.
    if not args.data_prefix:
        write_random_tokens(data, 256 if args.tiny else 50277, 32 * batch * (seq + 1) * args.iters)
    print(f"work dir: {work}", flush=True)
    records = []
    for model, run in plan:
        rec = measure(args, model, run, work, data)
        records.append(rec)
        common.emit(rec, args.json)
    print_table(records)
    return 0 if all(r["exit_code"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
