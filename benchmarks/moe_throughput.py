#!/usr/bin/env python
"""MoE training throughput (issue 37, part 6): the OLMoE-1B-7B shape cut in depth, every neox
run a real `deepy.py train.py configs/olmoe/1B-7B.yml <overlay>` launch on random tokens, against
a dense model of the same active FLOPs and transformers' own OlmoeForCausalLM.

python benchmarks/moe_throughput.py --plan 1gpu     # moe1 dense1 hf1 (one GPU)
python benchmarks/moe_throughput.py --plan 4gpu     # moe1 ep4 dp4_moe (4 GPUs)
python benchmarks/moe_throughput.py --runs moe1 ep4 --profile   # router/dispatch op table
python benchmarks/moe_throughput.py --tiny          # the same paths on CPU ranks, tiny shape

Runs (RUNS; bf16, ZeRO-1 = the flat engine, no activation checkpointing, NUM_LAYERS layers,
micro batch MICRO_BATCH of SEQ tokens per GPU, --accum micro batches a step):
  moe1     one GPU, 64 experts of width 1024, top-8 (all 16 of OLMoE's layers do not fit with
           Adam: NUM_LAYERS is the depth the dry run's estimate fits under ~70 GiB)
  dense1   one GPU, the same blocks with a dense SwiGLU MLP of width 8 x 1024 = 8192: the
           active FLOPs per token of moe1 (less its router)
  hf1      transformers' OlmoeForCausalLM at moe1's shape (random init, bf16 autocast,
           torch.compile, fused AdamW, SDPA) in a plain loop in this process, timed as
           benchmarks/train_throughput.py times HF: steps after warm-up, back to back
  ep4      4 GPUs, moe_expert_parallel_size 4 (16 experts a rank, all-to-all dispatch)
  ep2      2 GPUs, moe_expert_parallel_size 2 (32 experts a rank): ep4 on a 2-GPU kind
  dp4_moe  4 GPUs, data parallel only (every rank runs all 64 experts)
Accumulation: a step is --accum micro batches (default: STEP_TOKENS or more per GPU, 8 at
the device shape), the config's gradient_accumulation_steps for neox's runs (the path users run)
and the same micro batches summed before hf1's optimizer step; tokens/s and MFU count every
micro batch. Why: the optimizer's step reads and writes every weight, gradient and moment (28
bytes a parameter), ~100 GB a step at moe1's 3.56B parameters (~25 ms on an H200) against
~20 GB at dense1's 0.74B. At one 4,096-token micro batch a step that is a quarter of moe1's step
and a property of the tiny step, not of MoE: MoE runs step millions of tokens (OLMoE: 4M).
neox's tokens/s, TFLOPS and MFU come from the run's metrics.jsonl (MFU on active FLOPs: 6 x
active parameters + attention, neox.plan.estimate.train_flops_per_token), the mean of logged
steps --first..--iters (with --profile, up to the profiled two). The table prints the issue's ratios: moe1/dense1 MFU (>= 0.8),
moe1/hf1 tokens/s (>= 2), ep4 per-GPU tokens/s / moe1 (>= 0.85), and the estimate's counts
(total and active parameters, expert memory per rank, all-to-all bytes per step).
Schedule: the timed steps are the first ones of a run whose learning rate warms up over
--warmup-iters steps (gpt-neox's `warmup` fraction of lr_decay_iters), as a real run's first
steps are. With --warmup-iters 0 the schedule is compressed into the run (the file's full 4e-4
at step 1, cosine to the end): on random tokens the router then collapses within 3-5 steps
(docs/benchmarks.md, 2026-11-28 late: each layer's busiest EP=4 rank took 1.6-1.7x the mean
load), which EP measures as ranks waiting for the busiest one and one GPU does not see. The
table's `load` column states the routing of the timed steps: the mean over steps and layers of
the busiest of 4 expert groups' (EP=4's ranks'; ep2: 2 groups) share of the load over the mean
share.
--profile: neox's `profile` keys over the last two steps; the ops of the rank 0 trace summed
into router (softmax, top-k), dispatch (sort, bincount, gather/scatter/index), grouped GEMM,
all-to-all and the rest, as a share of the profiled device (on CPU: host) time.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.timeline import rank_timelines, timeline_lines  # noqa: E402
from benchmarks.train_multi_gpu import (  # noqa: E402
    OVERLAY as LAUNCH_OVERLAY,
)
from benchmarks.train_multi_gpu import (  # noqa: E402
    free_port,
    launch,
    logged_steps,
    summarize,
    write_random_tokens,
)

MODEL_FILE = ROOT / "configs" / "olmoe" / "1B-7B.yml"
# Depth, micro batch and sequence of every run: 8 of OLMoE's 16 layers fit one 80 GB H100 with
# Adam and no recompute (the dry run's estimate: tests/benchmarks/test_moe_throughput.py).
NUM_LAYERS, MICRO_BATCH, SEQ = 8, 1, 4096
# Tokens a GPU trains per optimizer step at least, unless --accum says otherwise.
STEP_TOKENS = 32 * 1024
TINY_ACCUM = 2  # --tiny: accumulation on the smoke path, kept short


def dense_intermediate_size(width: int) -> int:
    """intermediate_size giving a gated MLP `width` per branch (gpt-neox takes 2/3 of it, halved:
    neox/config/shape.py ffn_size)."""
    return 3 * width


# Run name -> keys over configs/olmoe/1B-7B.yml and OVERLAY (None: transformers, not a launch).
RUNS: dict[str, dict[str, Any] | None] = {
    "moe1": {"num_gpus": 1},
    "dense1": {
        "num_gpus": 1,
        "moe_num_experts": 1,
        "intermediate_size": dense_intermediate_size(8 * 1024),  # top-8 x 1024
    },
    "hf1": None,
    "ep4": {"num_gpus": 4, "moe_expert_parallel_size": 4},
    # The same dispatch on a 2-GPU kind (32 experts a rank): ep4's scaling at half the ranks.
    "ep2": {"num_gpus": 2, "moe_expert_parallel_size": 2},
    "dp4_moe": {"num_gpus": 4, "moe_expert_parallel_size": 1},
}
PLANS = {"1gpu": ["moe1", "dense1", "hf1"], "4gpu": ["moe1", "ep4", "dp4_moe"]}

OVERLAY: dict[str, Any] = {
    **LAUNCH_OVERLAY,
    "num_layers": NUM_LAYERS,
    "attention_config": [[["flash"], NUM_LAYERS]],
    "seq_length": SEQ,
    "max_position_embeddings": SEQ,
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "zero_optimization": {"stage": 1},
}
# CPU smoke shape: OLMoE's layout (q/k norms, SwiGLU experts, top-k softmax router) at 2 layers,
# 8 experts of width 32, top-2; 2 CPU ranks stand in for 4 GPUs.
TINY: dict[str, Any] = {
    **common.TINY,
    "num_workers": 0,
    "num_kv_heads": 4,
    "moe_num_experts": 8,
    "moe_top_k": 2,
    "moe_ffn_hidden_size": 32,
    "train_micro_batch_size_per_gpu": 2,
    "padded_vocab_size": None,
    "peak_theoretical_tflops": 1.0,  # a nominal CPU peak: the MFU columns and ratio are filled
}
TINY_RUNS: dict[str, dict[str, Any]] = {
    "dense1": {"moe_num_experts": 1, "intermediate_size": dense_intermediate_size(2 * 32)},
    "ep4": {"num_gpus": 2, "moe_expert_parallel_size": 2},
    "dp4_moe": {"num_gpus": 2, "moe_expert_parallel_size": 1},
}


def accumulation(args) -> int:
    """Micro batches a step: --accum, else enough for STEP_TOKENS a GPU (TINY_ACCUM on --tiny)."""
    if args.accum:
        return args.accum
    if args.tiny:
        return TINY_ACCUM
    return -(-STEP_TOKENS // ((args.micro_batch or MICRO_BATCH) * SEQ))


def run_keys(args, run: str) -> dict[str, Any]:
    """The overlay's keys of a neox run."""
    keys = {**OVERLAY, "train_iters": args.iters, "lr_decay_iters": args.iters, "warmup": 0.0}
    if args.warmup_iters:
        keys |= {"lr_decay_iters": 100 * args.warmup_iters, "warmup": 0.01}
    keys["gradient_accumulation_steps"] = accumulation(args)
    if args.micro_batch:
        keys["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.num_layers:
        keys |= {"num_layers": args.num_layers}
        keys["attention_config"] = [[["flash"], args.num_layers]]
    keys |= RUNS[run] or {}
    if args.tiny:
        keys |= TINY | TINY_RUNS.get(run, {})
    elif args.vocab_file:
        keys["vocab_file"] = args.vocab_file
    if args.profile:  # torch.profiler over the last two steps, every rank
        keys |= {"profile": True, "profile_step_start": args.iters - 1}
        keys["profile_step_stop"] = args.iters
    return keys


def run_config(args, run: str, work: Path, data: Path) -> Path:
    """The overlay file of one neox run under `work`."""
    keys = run_keys(args, run) | {"data_path": str(data), "log_dir": str(work / run)}
    keys["master_port"] = free_port()
    path = work / f"{run}.yml"
    path.write_text(yaml.safe_dump(keys))
    return path


def load_run(args, run: str):
    """(config, derived, padded vocab) of a run as deepy.py would validate it (no data)."""
    from neox.config import derive, load_config
    from neox.tokenizer.char import CHAR_VOCAB_SIZE

    keys = run_keys(args, "moe1" if RUNS[run] is None else run) | {"data_path": None}
    cfg = load_config([str(MODEL_FILE)], overrides=keys).config
    # The tokenizer's vocabulary (the 20B tokenizer's; the file pads it to 50304).
    d = derive(cfg, keys["num_gpus"], CHAR_VOCAB_SIZE if args.tiny else 50277)
    return cfg, d, d.padded_vocab_size


def plan_estimate(args, run: str) -> dict[str, Any]:
    """The estimate's counts of a run: total and active parameters, expert weights each rank
    holds (all) and computes (1 / EP), all-to-all bytes a rank sends per step, FLOPs per token."""
    from neox.plan.estimate import (
        active_parameters,
        all_to_all_bytes,
        count_parameters,
        expert_parameters,
        train_flops_per_token,
    )

    cfg, d, vocab = load_run(args, run)
    m, ep = cfg.model, cfg.model.moe_expert_parallel_size
    element = 4 if d.precision == "fp32" else 2
    tokens = d.micro_batch * d.grad_accum * m.seq_length
    moe = m.moe_num_experts > 1
    return {
        "total_params": count_parameters(m, vocab),
        "active_params": active_parameters(m, vocab),
        "expert_params_held": expert_parameters(m) if moe else 0,
        "expert_params_computed": expert_parameters(m, ep) if moe else 0,
        "expert_weight_gib_per_rank": (expert_parameters(m) if moe else 0) * element / 2**30,
        "all_to_all_gib_per_step": (all_to_all_bytes(m, tokens, ep, element) if moe else 0) / 2**30,
        "flops_per_token": train_flops_per_token(m, vocab),
        "num_gpus": d.world_size,
    }


def hf_olmoe_step(
    cfg, micro_batch: int, accum: int, vocab: int, device, compile_: bool, experts: str | None
):
    """transformers' OlmoeForCausalLM at cfg's shape: SDPA, bf16 autocast, fused AdamW, its
    own expert modules (`experts`: transformers' experts_implementation, None for its default);
    a step sums the gradients of `accum` micro batches (each loss / accum, as neox's engines
    weigh them) before the optimizer's step."""
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from benchmarks.train_throughput import random_batches

    m = cfg.model
    hf_cfg = OlmoeConfig(
        vocab_size=vocab,
        hidden_size=m.hidden_size,
        intermediate_size=m.moe_ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.shape.kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.rms_norm_epsilon,
        num_experts=m.moe_num_experts,
        num_experts_per_tok=m.moe_top_k,
        norm_topk_prob=m.moe_norm_topk_prob,
        router_aux_loss_coef=m.moe_loss_coeff,
        output_router_logits=True,  # its load-balancing loss, as neox's runs add theirs
        tie_word_embeddings=False,
        eos_token_id=None,  # random tokens: no document ends
    )
    hf_cfg._attn_implementation = "sdpa"
    if experts:
        hf_cfg._experts_implementation = experts
    model = OlmoeForCausalLM(hf_cfg).to(device)
    model.train()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, betas=(0.9, 0.95), fused=fused)
    fwd = torch.compile(model) if compile_ else model
    batches = random_batches(vocab, micro_batch, m.seq_length, device)
    bf16 = device.type == "cuda"

    def step(i: int) -> Any:
        losses = []
        for j in range(accum):
            tokens = batches[(i * accum + j) % len(batches)]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = fwd(input_ids=tokens[:, :-1], labels=tokens[:, :-1])  # HF shifts them
            (out.loss / accum).backward()
            losses.append(out.loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean()

    return step, getattr(hf_cfg, "_experts_implementation", None)  # transformers >= 5


def measure_hf(args) -> dict[str, Any]:
    """hf1: moe1's shape in transformers, on this process's first device."""
    import os

    # Less fragmentation: at moe1's depth the fp32 weights, gradients and AdamW states leave
    # transformers' activations little room (set before this process first touches CUDA).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from benchmarks.train_throughput import time_steps

    cfg, d, vocab = load_run(args, "hf1")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    compile_ = not args.tiny  # the smoke run checks the path, not inductor on CPU
    try:
        step, experts = hf_olmoe_step(
            cfg, d.micro_batch, d.grad_accum, vocab, device, compile_, args.hf_experts
        )
        times = time_steps(step, args.iters, args.first, device)
    except torch.OutOfMemoryError as e:
        # fp32 weights, gradients and AdamW states leave transformers' activations less room
        # than neox's: the record says so, and a shallower --num-layers for both runs fits.
        return {"run": "hf1", "exit_code": 1, "error": f"out of memory: {str(e)[:300]}"}
    mean = sum(times) / len(times)
    tokens = d.micro_batch * d.grad_accum * cfg.model.seq_length  # every micro batch
    rec: dict[str, Any] = {"run": "hf1", "exit_code": 0, "compile": compile_}
    rec["accum"] = d.grad_accum
    rec |= {"experts_implementation": experts, "step_ms": 1000 * mean}
    rec["tokens_per_s"] = tokens / mean
    flops = plan_estimate(args, "hf1")["flops_per_token"]
    rec["tflops_per_gpu"] = rec["tokens_per_s"] * flops / 1e12
    from neox.training.metrics import peak_tflops

    peak = cfg.logging.peak_theoretical_tflops or peak_tflops(device)
    rec["mfu"] = rec["tflops_per_gpu"] / peak if peak else None
    if device.type == "cuda":
        rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    del step
    gc.collect()
    if device.type == "cuda":  # a later launch needs this GPU's memory
        torch.cuda.empty_cache()
    return rec


# Op and kernel names -> part of an MoE step (first match wins). aten names are the eager (CPU)
# ops; a CUDA kernel is named with the aten op that launched it where there is one (the grouped
# GEMM's CUTLASS kernel names no "grouped"), and kernels of compiled code carry the fused ops in
# their own names (triton_..._topk_...).
OP_PARTS: list[tuple[str, str]] = [
    ("all-to-all", r"all_to_all|alltoall|SendRecv"),
    ("grouped gemm", r"(?i)grouped|aten::bmm\b"),
    # The router's softmax; not the loss's log_softmax, whose fused kernels also name an online
    # softmax (attention's runs inside flash kernels).
    ("router", r"(?i)topk|^(?!.*log_?softmax).*softmax"),
    # Not the norms' and rotary's fused kernels (their cat and index), nor the engine's
    # all-gather and reduce-scatter; the embedding's index and sort kernels are in here (a dense
    # model's share of this part is that).
    (
        "dispatch",
        r"(?i)^(?!.*rms_norm)(?:.*(?:sort|bincount|histc|index|(?<!reduce_)(?<!reduce)scatter"
        r"|(?<!all)gather|cumsum))",
    ),
]


def op_part(name: str) -> str | None:
    for part, pattern in OP_PARTS:
        if re.search(pattern, name):
            return part
    return None


def self_times(ops: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(name, own microseconds) of nested host ops: each op's duration less its children's."""
    out: dict[int, list] = {}
    stack: list[list] = []
    for e in sorted(ops, key=lambda e: (e["tid"], e["ts"], -e["dur"])):
        while stack and (stack[-1][0] != e["tid"] or stack[-1][1] <= e["ts"]):
            stack.pop()
        entry = [e["tid"], e["ts"] + e["dur"], e["name"], e["dur"]]
        if stack:
            stack[-1][3] -= e["dur"]
        stack.append(entry)
        out[id(entry)] = entry
    return [(name, own) for _, _, name, own in out.values()]


def kernel_names(events: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(name, microseconds) of each device kernel, its name after the aten op that launched it
    where one did (the trace links them by "External id")."""
    ops = {
        e.get("args", {}).get("External id"): e["name"]
        for e in events
        if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")
    }
    out = []
    for e in events:
        if e.get("cat") == "kernel":
            op = ops.get(e.get("args", {}).get("External id"))
            out.append((f"{op} {e['name']}" if op else e["name"], e["dur"]))
    return out


def profile_parts(trace: Path) -> dict[str, Any]:
    """ms per step of each OP_PARTS part and of everything, from a neox profile trace of two
    steps: the device kernels on GPUs, the host ops' own time on CPU ranks."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    timed = kernel_names(events)
    if not timed:
        timed = self_times([e for e in events if e.get("cat") == "cpu_op"])
    parts = {part: Counter() for part, _ in OP_PARTS}
    total = 0.0
    for name, us in timed:
        total += us / 1e3 / 2
        part = op_part(name)
        if part:
            parts[part][name] += us / 1e3 / 2
    out: dict[str, Any] = {"total_ms": total}
    for part, names in parts.items():
        out[f"{part}_ms"] = sum(names.values())
        # What was counted, to check the names against the trace.
        out[f"{part}_top"] = [[n[:100], round(ms, 3)] for n, ms in names.most_common(4)]
    return out


def rank_load(metrics: Path, first: int, last: int, ranks: int = 4) -> float | None:
    """Mean over logged steps first..last and MoE layers of max / mean of the load (the logged
    `moe/<layer>/load/<expert>` fractions) summed over `ranks` groups of consecutive experts:
    1.0 when every EP rank would compute the same rows, 4.0 when one computes them all."""
    ratios = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if not first <= row.get("step", 0) <= last:
            continue
        layers: dict[str, dict[int, float]] = {}
        for key, value in row.items():
            m = re.fullmatch(r"moe/(\d+)/load/(\d+)", key)
            if m:
                layers.setdefault(m[1], {})[int(m[2])] = value
        for loads in layers.values():
            experts = len(loads)
            if experts % ranks or not sum(loads.values()):
                continue
            size = experts // ranks
            shares = [sum(loads[e] for e in range(g * size, (g + 1) * size)) for g in range(ranks)]
            ratios.append(max(shares) / (sum(shares) / ranks))
    return sum(ratios) / len(ratios) if ratios else None


def measure(args, run: str, work: Path, data: Path) -> dict[str, Any]:
    if RUNS[run] is None:
        return measure_hf(args)
    overlay = run_config(args, run, work, data)
    log = work / f"{run}.log"
    code, seconds, _ = launch(args, MODEL_FILE, overlay, log)
    rec: dict[str, Any] = {"run": run, "exit_code": code, "wall_s": seconds}
    rec["accum"] = accumulation(args)
    metrics = work / run / "metrics.jsonl"
    last = args.iters - 2 if args.profile else args.iters  # profiled steps run slower
    if metrics.is_file() and logged_steps(metrics) >= last:
        rec |= summarize(metrics, args.first, last)
        # Over the run's EP ranks; over EP=4's where it has none (one GPU, data parallel only).
        ep = RUNS[run].get("moe_expert_parallel_size", 1)
        rec["load"] = rank_load(metrics, args.first, last, ep if ep > 1 else 4)
        if code != 0:  # e.g. the time limit reached while the profiler wrote its traces
            rec["ended_after_timed_steps"] = True
    else:
        rec["error"] = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    traces = sorted((work / run / "profile").glob("rank0_*.trace.json"))
    if args.profile and traces:
        rec["profile"] = profile_parts(traces[-1])
        # Every rank's busy, exposed all-to-all and idle time: a rank waiting for the busiest.
        rec["timeline"] = rank_timelines(work / run / "profile")
    return rec


def targets(by: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's ratios, for the runs present."""
    out = []
    moe, dense, hf = by.get("moe1"), by.get("dense1"), by.get("hf1")
    if moe and dense and moe.get("mfu") and dense.get("mfu"):
        out.append(f"moe1 / dense1 MFU = {moe['mfu'] / dense['mfu']:.2f} (target >= 0.8)")
    if moe and hf:
        ratio = moe["tokens_per_s"] / hf["tokens_per_s"]
        out.append(f"moe1 / hf1 tokens/s = {ratio:.2f} (target >= 2)")
    for run in ("ep4", "ep2", "dp4_moe"):
        if moe and run in by:
            ratio = by[run]["tokens_per_s"] / by[run]["num_gpus"] / moe["tokens_per_s"]
            out.append(f"{run} per-GPU tokens/s / moe1 = {ratio:.2f} (target >= 0.85 for ep4)")
    return out


def print_table(records: list[dict[str, Any]]) -> None:
    print(
        f"{'run':>8} {'gpus':>4} {'accum':>5} {'tok/s':>9} {'ms/step':>8} {'TFLOPS/gpu':>10} "
        f"{'MFU':>6} {'peak GB':>8} {'total M':>8} {'active M':>8} {'experts GiB':>11} "
        f"{'a2a GiB':>7} {'load':>5}"
    )
    for r in records:
        if "tokens_per_s" not in r:
            error = r.get("error", "").strip().splitlines()[-1:] or ["see its log"]
            print(f"{r['run']:>8} failed (exit {r['exit_code']}): {error[0]}")
            continue
        if r.get("ended_after_timed_steps"):
            print(f"{r['run']:>8}: exit {r['exit_code']} after its timed steps (below)")
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        mem = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") is not None else "-"
        load = f"{r['load']:.2f}" if r.get("load") else "-"
        print(
            f"{r['run']:>8} {r['num_gpus']:>4} {r['accum']:>5} {r['tokens_per_s']:>9.0f} "
            f"{r['step_ms']:>8.1f} {r['tflops_per_gpu'] or 0:>10.1f} {mfu:>6} {mem:>8} "
            f"{r['total_params'] / 1e6:>8.1f} {r['active_params'] / 1e6:>8.1f} "
            f"{r['expert_weight_gib_per_rank']:>11.2f} {r['all_to_all_gib_per_step']:>7.2f} "
            f"{load:>5}"
        )
    for r in records:
        if "profile" in r:
            p = r["profile"]
            shares = ", ".join(
                f"{part} {p[f'{part}_ms']:.1f} ms ({p[f'{part}_ms'] / p['total_ms']:.1%})"
                for part, _ in OP_PARTS
            )
            print(f"{r['run']} profile, of {p['total_ms']:.1f} ms a step: {shares}")
        for line in timeline_lines(r["run"], r.get("timeline", {})):
            print(line)
    for line in targets({r["run"]: r for r in records if "tokens_per_s" in r}):
        print(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--plan", choices=list(PLANS), default=None, help="the runs of one machine")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=None)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--first", type=int, default=8, help="first logged step averaged")
    p.add_argument("--num-layers", type=int, default=None, help=f"default {NUM_LAYERS}")
    p.add_argument("--micro-batch", type=int, default=None, help=f"default {MICRO_BATCH}")
    p.add_argument(
        "--accum",
        type=int,
        default=None,
        help=f"micro batches a step (default: {STEP_TOKENS:,}+ tokens a GPU, {TINY_ACCUM} --tiny)",
    )
    p.add_argument("--vocab-file", default="data/20B_tokenizer.json")
    p.add_argument("--hf-experts", default=None, help="hf1's experts_implementation")
    p.add_argument("--profile", action="store_true", help="router/dispatch op table (above)")
    p.add_argument("--timeout", type=float, default=480, help="seconds per launch")
    p.add_argument(
        "--warmup-iters",
        type=int,
        default=1000,
        help="the lr warms up over this many steps (0: the schedule compressed into the run)",
    )
    p.add_argument("--work-dir", default=None, help="keep configs, logs and metrics here")
    p.add_argument("--json", default=None, help="append one JSON record per run here")
    p.add_argument("--tiny", action="store_true", help="tiny shape on CPU ranks: a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        args.iters, args.first, args.vocab_file = min(args.iters, 6), min(args.first, 2), None
    elif not (ROOT / args.vocab_file).is_file() and not Path(args.vocab_file).is_file():
        p.error(f"--vocab-file {args.vocab_file} not found: pass the GPT-NeoX-20B tokenizer json")
    if args.profile and args.first > args.iters - 2:
        p.error(f"--profile times steps --first..--iters - 2: give --iters >= {args.first + 2}")
    runs = args.runs or PLANS[args.plan or "1gpu"] + (PLANS["4gpu"][1:] if not args.plan else [])
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="neox_moe_"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "random_tokens"
    seq = run_keys(args, "moe1")["seq_length"]
    batch = run_keys(args, "moe1")["train_micro_batch_size_per_gpu"]
    # Every run's tokens, 4 GPUs' worth, twice over.
    tokens = 8 * batch * accumulation(args) * (seq + 1) * args.iters
    write_random_tokens(data, 256 if args.tiny else 50277, tokens)
    print(f"work dir: {work}", flush=True)
    records = []
    for run in runs:
        rec = measure(args, run, work, data) | plan_estimate(args, run)
        records.append(rec)
        common.emit(rec, args.json)
    print_table(records)
    return 0 if all(r["exit_code"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
