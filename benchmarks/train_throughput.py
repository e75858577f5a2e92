#!/usr/bin/env python
"""Training throughput on one device: neox's real step (build_run + train_step) against HF
GPTNeoXForCausalLM, eager and torch.compile, at Pythia shapes, random tokens.

python benchmarks/train_throughput.py --vocab-file data/20B_tokenizer.json        # 160M 410M 1-4B
python benchmarks/train_throughput.py --models 410M --impls neox --profile-dir prof
python benchmarks/train_throughput.py --models 410M --impls neox --attention flash triton
python benchmarks/train_throughput.py --tiny                                       # CPU smoke run
python benchmarks/train_throughput.py --models 1-4B --long-context 2k 8k 8k_packed 16k 32k
python benchmarks/train_throughput.py --models 1-4B --impls neox hf_compile --grad-accum 8
python benchmarks/train_throughput.py --models 1-4B --impls neox --variants bf16 fp8 zero3
python benchmarks/train_throughput.py --models 6-9B --num-layers 8 --impls neox --variants bf16 fp8

Prints tokens/s, TFLOPS, MFU (neox.plan.estimate.train_flops_per_token), peak memory, and neox's
ratio to each HF variant; --json appends one record per run. Results go in docs/benchmarks.md.
--attention runs neox once per attention kernel (attention_impl: flash = torch SDPA, triton =
scores + the Triton fused softmax, as global layers with the gpt-neox fusion flags take it) at
the same shape, and prints their ratio.
--long-context runs neox at longer sequences on the model's shape (LONG_CONTEXT: micro batch,
activation checkpointing, chunked loss; `_packed` rows pack documents of --doc-length tokens on
average with reset_attention_mask) and prints each row's tokens/s against the first row's.
--variants runs neox with FP8 (and its options), ZeRO-3 (and its options) or ZeRO-3 + CPU
offload (VARIANTS), each beside bf16 at the same micro batch, and records the host memory the
run added against the estimate's ZeRO-Offload count; with --profile-dir, each profiled run
also reports its device time per step by kind of kernel (matmuls bf16/float8, attention,
torchao's amax and cast kernels, the rest). A neox step is gradient_accumulation_steps micro
batches, as the config says (the 6.9B file: 2), and its tokens are counted so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from neox.config import load_config  # noqa: E402
from neox.config.derived import precision_of  # noqa: E402
from neox.plan.estimate import train_flops_per_token  # noqa: E402
from neox.training.metrics import peak_tflops  # noqa: E402

# Pythia shape -> micro batch that fits one 80 GB H100 without activation checkpointing (6.9B:
# a slice of its width, --num-layers; 2.8B: under ZeRO-3 + offload).
MICRO_BATCH = {"160M": 16, "410M": 8, "1-4B": 4, "2-8B": 4, "6-9B": 4}
DEFAULT_MODELS = ["160M", "410M", "1-4B"]

# --variants: neox runs with these keys on top of the model file (bf16: as the file says).
_ZERO3 = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
_FP8_ALL = {"enabled": True, "skip_first_layers": 0, "skip_last_layers": 0}
# The attempts of 2026-11-26 (docs/benchmarks.md) ran with torch's own linear beside the leaves.
_Z3_TORCH_LINEAR = {**_ZERO3, "memory_efficient_linear": False}
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "fp8": {"fp8": {"enabled": True}},
    "fp8_rowwise": {"fp8": {"enabled": True, "recipe": "rowwise"}},
    "fp8_all_layers": {"fp8": _FP8_ALL},
    # The output layer in float8 too, and the backward matmuls' fast accumulation.
    "fp8_output_layer": {"fp8": {"enabled": True, "output_layer": True}},
    "fp8_all_output": {"fp8": {**_FP8_ALL, "output_layer": True}},
    "fp8_all_output_fast": {"fp8": {**_FP8_ALL, "output_layer": True, "fast_accum_backward": True}},
    "fp8_output_fast": {
        "fp8": {"enabled": True, "output_layer": True, "fast_accum_backward": True}
    },
    "fp8_all_rowwise": {"fp8": {**_FP8_ALL, "recipe": "rowwise", "output_layer": True}},
    # Fewer casts (the 4h-wide tensors' amax and transposed casts cost most, docs/benchmarks.md):
    # the weight gradient in bf16, or the 4h -> h linear (its input is the GELU output) in bf16.
    "fp8_all_output_fast_bf16_wgrad": {
        "fp8": {**_FP8_ALL, "output_layer": True, "fast_accum_backward": True, "wgrad": False}
    },
    "fp8_all_output_fast_no_4h_to_h": {
        "fp8": {
            **_FP8_ALL,
            "output_layer": True,
            "fast_accum_backward": True,
            "modules": ["attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h"],
        }
    },
    # neox's ZeRO-3: blocks as ZeRO-3 leaves (neox.config.ds_config.ZERO3_DEFAULTS).
    "zero3": {"zero_optimization": _ZERO3},
    # As measured on 2026-11-26 (docs/benchmarks.md): leaves and torch's own linear.
    "zero3_torch_linear": {"zero_optimization": _Z3_TORCH_LINEAR},
    # DeepSpeed's own ZeRO-3 defaults: hooks on every module.
    "zero3_ds_defaults": {"zero_optimization": {**_ZERO3, "leaf_module": {"classes": []}}},
    # Larger gathers and every parameter kept whole: ZeRO-3 at one rank has nothing to shard.
    "zero3_prefetch": {
        "zero_optimization": {
            **_ZERO3,
            "stage3_prefetch_bucket_size": 500_000_000,
            "stage3_max_live_parameters": 3_000_000_000,
            "stage3_max_reuse_distance": 3_000_000_000,
        }
    },
    "zero3_persist": {
        "zero_optimization": {**_ZERO3, "stage3_param_persistence_threshold": 10**12}
    },
    # DeepSpeed's engine reads its wall_clock_breakdown timers (the Pythia files turn it on) at
    # every step, each read a device sync; the flat engine reads them at steps_per_print only.
    "zero3_no_timers": {"zero_optimization": _Z3_TORCH_LINEAR, "wall_clock_breakdown": False},
    # neox's ZeRO-3 defaults without the per-step timer reads, with and without gathers.
    "zero3_quiet": {"zero_optimization": _ZERO3, "wall_clock_breakdown": False},
    "zero3_quiet_persist": {
        "zero_optimization": {**_ZERO3, "stage3_param_persistence_threshold": 10**12},
        "wall_clock_breakdown": False,
    },
    # One rank has nothing to overlap: no side stream for gradients, one optimizer sub-group.
    "zero3_one_rank": {
        "zero_optimization": {**_Z3_TORCH_LINEAR, "overlap_comm": False, "sub_group_size": 10**10},
        "wall_clock_breakdown": False,
    },
    "zero3_one_rank_persist": {
        "zero_optimization": {
            **_Z3_TORCH_LINEAR,
            "overlap_comm": False,
            "sub_group_size": 10**10,
            "stage3_param_persistence_threshold": 10**12,
        },
        "wall_clock_breakdown": False,
    },
    # DeepSpeed's DeepCompile: the whole module compiled with ZeRO-3's gathers in the graph
    # (in place of neox's per-block torch.compile).
    "zero3_deepcompile": {
        # No leaf modules (neox sets none under DeepCompile): their backward hooks reduce into
        # buckets DeepCompile does not set up.
        "zero_optimization": {**_Z3_TORCH_LINEAR, "leaf_module": {"classes": []}},
        "torch_compile": False,
        "wall_clock_breakdown": False,
        "deepspeed_extra_args": {"compile": {"deepcompile": True}},
    },
    "zero3_fp8": {"zero_optimization": _ZERO3, "fp8": {"enabled": True}},
    "zero3_offload": {
        "zero_optimization": {
            **_ZERO3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
        "checkpoint_activations": True,
    },
}

# Overlay on configs/pythia/<M>.yml: bf16, no recompute, nothing written to disk.
OVERLAY: dict[str, Any] = {
    **common.OVERLAY,
    "log_dir": None,
    "train_iters": 100,
    "log_interval": 10**6,
    "model_parallel_size": 1,  # one device (the 6.9B and larger files say 2 or more)
    "pipe_parallel_size": 1,
}
TINY: dict[str, Any] = {**common.TINY, "zero_optimization": {"stage": 1}}


TORCH_LINEAR = torch.nn.functional.linear


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def neox_config(model: str, micro_batch: int, vocab_file: str | None, tiny: bool, extra: dict):
    overrides = {**OVERLAY, "train_micro_batch_size_per_gpu": micro_batch}
    overrides["master_port"] = int(os.environ.get("MASTER_PORT", free_port()))
    if vocab_file:
        overrides["vocab_file"] = vocab_file
    if tiny:
        overrides.update(TINY)
    overrides.update(extra)
    return load_config([ROOT / "configs" / "pythia" / f"{model}.yml"], overrides=overrides).config


def random_batches(vocab: int, micro_batch: int, seq: int, device, n: int = 4) -> list[Any]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, vocab, (micro_batch, seq + 1), generator=g).to(device) for _ in range(n)
    ]


def cycle(items: list[Any]) -> Iterator[Any]:
    while True:
        yield from items


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[int], Any], iters: int, warmup: int, device) -> list[float]:
    """Seconds per step for steps warmup..iters (the first ones compile and warm caches).

    Steps run back to back, as in a training loop: the host may queue a step while the device
    still runs the one before, so each step's time is the interval between the ends of two
    calls, and the device is synchronised once, after the last."""
    for i in range(warmup):
        tick = time.perf_counter()
        step(i)
        sync(device)
        # Compilation happens here: a run stopped by a time limit still says how far it got.
        print(f"warmup step {i}: {time.perf_counter() - tick:.1f} s", flush=True)
    ends = [time.perf_counter()]
    for i in range(warmup, iters):
        step(i)
        if i == iters - 1:
            sync(device)
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])]


def host_profile(step: Callable[[int], Any], start: int, device, path: str) -> list:
    """cProfile over two steps: where the host spends a step (ZeRO-3's Python, for one). The
    top functions by cumulative time go to `path` and into the record."""
    import cProfile
    import pstats

    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(start, start + 2):
        step(i)
    sync(device)
    prof.disable()
    with open(path, "a") as f:
        stats = pstats.Stats(prof, stream=f)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)
    top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][3])[:40]
    return [
        [
            f"{os.path.relpath(fn, ROOT) if fn.startswith('/') else fn}:{line}:{name}",
            ncalls // 2,
            round(cum * 500, 2),
        ]  # calls a step, cumulative ms a step
        for (fn, line, name), (_, ncalls, _, cum, _) in top
    ]


def count_syncs(step: Callable[[int], Any], i: int, device) -> Counter:
    """Host-device synchronisations of one step, by the Python line that caused them."""
    if device.type != "cuda":
        return Counter()
    sync(device)
    sites: Counter = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(i)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"] += 1
    return sites


# Ops whose device time the profile sums (their kernels run inside the compiled graphs too):
# float8 and bf16 matmuls, flash attention forward and backward.
PROFILED_OPS = {
    "aten::_scaled_mm": "gemm float8",
    "aten::mm": "gemm bf16",
    "aten::addmm": "gemm bf16",
    "aten::bmm": "gemm bf16",
    "aten::_flash_attention_forward": "attention",
    "aten::_flash_attention_backward": "attention",
    "aten::_efficient_attention_forward": "attention",
    "aten::_efficient_attention_backward": "attention",
}


def kernel_kind(name: str) -> str:
    """What a device kernel does, from its name. Inductor names a Triton kernel after the aten
    ops fused into it: torchao's tensorwise scale is max(abs(x)) ("abs" and "max"), its cast
    clamps to the float8 range ("clamp"); a name with more ops than those is a fused one."""
    n = name.lower()
    if n.startswith("triton"):
        if "abs" in n and "max" in n:
            return "fp8 amax (triton)"
        if "clamp" in n:
            return "fp8 cast (triton)"
        return "other triton"
    if "flash" in n or "fmha" in n:
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "gemm"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other (eager)"


def profile_steps(
    step: Callable[[int], Any], start: int, out_dir: Path, name: str, device
) -> dict[str, Any]:
    """A torch.profiler trace of two steps, the top ops by self CPU and device time, and the
    device time per step by kind of kernel (kernel_kind, PROFILED_OPS), returned."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    out_dir.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps = 2
    sync(device)
    tick = time.perf_counter()
    with profile(activities=acts) as prof:
        for i in range(start, start + steps):
            step(i)
        sync(device)
    wall_ms = (time.perf_counter() - tick) * 1e3 / steps
    prof.export_chrome_trace(str(out_dir / f"{name}.trace.json"))
    avg = prof.key_averages()
    dev_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    # Kernels of one stream do not overlap, so their summed time is the device's busy time;
    # the rest of the step's wall time the device waited for the host.
    kernels = [e for e in prof.events() if e.device_type != DeviceType.CPU]
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps
    kinds_ms: Counter = Counter()
    kinds_n: Counter = Counter()
    by_name_ms: Counter = Counter()
    by_name_n: Counter = Counter()
    for e in kernels:
        ms = e.time_range.elapsed_us() / 1e3 / steps
        kinds_ms[kernel_kind(e.name)] += ms
        kinds_n[kernel_kind(e.name)] += 1 / steps
        by_name_ms[e.name] += ms
        by_name_n[e.name] += 1 / steps
    ops_ms: Counter = Counter()
    for a in avg:
        if a.key in PROFILED_OPS:
            ops_ms[PROFILED_OPS[a.key]] += getattr(a, "device_time_total", 0) / 1e3 / steps
    result = {
        "busy_ms": busy_ms,
        "wall_ms": wall_ms,
        "ops_ms": {k: round(v, 2) for k, v in ops_ms.most_common()},
        "kinds_ms": {k: round(v, 2) for k, v in kinds_ms.most_common()},
        "kinds_per_step": {k: round(v) for k, v in kinds_n.most_common()},
        "top_kernels": [
            [k[:120], round(v, 2), round(by_name_n[k])] for k, v in by_name_ms.most_common(25)
        ],
    }
    print(f"{name}: device busy {busy_ms:.1f} ms of {wall_ms:.1f} ms per profiled step")
    print(f"{name}: ms per step by op {result['ops_ms']}")
    print(f"{name}: ms per step by kernel kind {result['kinds_ms']}")
    print(f"{name}: kernels per step by kind {result['kinds_per_step']}")
    with open(out_dir / f"{name}.ops.txt", "w") as f:
        f.write(f"device busy {busy_ms:.1f} ms of {wall_ms:.1f} ms per step\n\n")
        f.write(json.dumps(result, indent=1) + "\n\n")
        f.write(avg.table(sort_by="self_cpu_time_total", row_limit=40))
        f.write("\n\n")
        f.write(avg.table(sort_by=dev_key, row_limit=60))
    return result


def neox_step(
    cfg, device, doc_length: int | None = None
) -> tuple[Callable[[int], Any], Any, Callable[[], None]]:
    """neox's own training step on the engine train.py builds (with `doc_length`, random
    documents of that mean length end in EOD)."""
    from neox.training.loop import train_step
    from neox.training.setup import build_run

    run = build_run(cfg)
    d = run.derived
    batches = random_batches(run.tokenizer.vocab_size, d.micro_batch, cfg.model.seq_length, device)
    if doc_length:
        batches = [
            end_documents(b, run.tokenizer.eod, doc_length, i) for i, b in enumerate(batches)
        ]
    stream = cycle([{"text": b} for b in batches])

    pending = []

    def step(i: int) -> Any:
        # As the loop (StepRecords): read a step's metrics once the next one is queued.
        pending.append(train_step(run, stream, i))
        return pending.pop(0).read() if len(pending) > 1 else None

    def close() -> None:
        run.engine.destroy() if hasattr(run.engine, "destroy") else None

    return step, run, close


def hf_step(cfg, vocab: int, micro_batch: int, device, compile_: bool, accum: int = 1):
    """HF GPTNeoXForCausalLM with SDPA, bf16 autocast and fused AdamW: the usual HF recipe,
    `accum` micro batches (each loss divided by `accum`) per optimizer step."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    m, shape = cfg.model, cfg.model.shape
    hf_cfg = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        intermediate_size=shape.ffn_size,
        rotary_pct=m.rotary_pct,
        max_position_embeddings=shape.max_positions,
        use_parallel_residual=m.gpt_j_residual,
        tie_word_embeddings=not m.no_weight_tying,
        hidden_act="gelu",
        attn_implementation="sdpa",
    )
    model = GPTNeoXForCausalLM(hf_cfg).to(device)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=device.type == "cuda"
    )
    fwd = torch.compile(model) if compile_ else model
    batches = random_batches(vocab, micro_batch, m.seq_length, device)
    bf16 = precision_of(cfg) == "bf16"

    def step(i: int) -> Any:
        for j in range(accum):
            tokens = batches[(i * accum + j) % len(batches)]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = fwd(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
            (out.loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    return step, model, lambda: None


def host_rss() -> int:
    """This process's resident host memory now (bytes), pinned buffers included."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def estimated_host(cfg, vocab: int) -> int:
    """The memory estimate's ZeRO-Offload host bytes for this run (neox/plan/memory.py)."""
    from neox.config import derive
    from neox.plan.memory import estimate_memory, training_shape

    return estimate_memory(cfg.model, training_shape(cfg, derive(cfg, 1, vocab), vocab)).host_total


def run_one(
    args, model: str, impl: str, device, attention: str = "config", variant: str = "bf16"
) -> dict[str, Any]:
    micro_batch = args.micro_batch or (2 if args.tiny else MICRO_BATCH[model])
    extra = dict(json.loads(args.neox_overrides)) if args.neox_overrides else {}
    if attention != "config":
        extra["attention_impl"] = attention
    if args.num_layers:  # a slice: every layer flash attention, as the Pythia files say
        extra["num_layers"] = args.num_layers
        extra["attention_config"] = [[["flash"], args.num_layers]]
    if args.grad_accum:
        extra["gradient_accumulation_steps"] = args.grad_accum
    if impl == "neox":
        extra.update(VARIANTS[variant])
        if args.tiny and "fp8" in extra:
            extra.pop("fp8")  # no float8 matmuls on CPU: the smoke run keeps the row's shape
    cfg = neox_config(model, micro_batch, args.vocab_file, args.tiny, extra)
    from neox.config import derive
    from neox.tokenizer import build_tokenizer

    t = cfg.tokenizer
    derived = derive(
        cfg, 1, build_tokenizer(t.tokenizer_type, t.vocab_file, t.merge_file).vocab_size
    )
    vocab = derived.padded_vocab_size
    # A step runs the config's gradient_accumulation_steps micro batches (the 6.9B file says 2;
    # --grad-accum overrides it), for neox and HF alike.
    grad_accum = derived.grad_accum
    # Each run compiles its own graphs: one process's dynamo cache would otherwise carry the
    # earlier runs' entries into this one's recompile limit (and fall back to eager).
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    base_mem = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        # Whatever an earlier run in this process left allocated is not this run's.
        base_mem = torch.cuda.memory_allocated(device)
    rss_before = host_rss()
    if impl == "neox":
        doc_length = getattr(args, "doc_length", None) if cfg.data.reset_attention_mask else None
        step, keep, close = neox_step(cfg, device, doc_length)
    else:
        step, keep, close = hf_step(
            cfg, vocab, micro_batch, device, impl == "hf_compile", grad_accum
        )
    times = time_steps(step, args.iters, args.warmup, device)
    rss_after = host_rss()
    mean = sum(times) / len(times)
    tokens = micro_batch * grad_accum * cfg.model.seq_length
    dynamo = torch._dynamo.utils.counters
    flops = train_flops_per_token(cfg.model, vocab)
    tps = tokens / mean
    peak = args.peak_tflops or peak_tflops(device)
    rec = {
        "model": model,
        "impl": impl,
        "attention": attention if impl == "neox" else "sdpa",
        "micro_batch": micro_batch,
        "grad_accum": grad_accum,
        "seq": cfg.model.seq_length,
        "step_ms": 1000 * mean,
        "step_ms_min": 1000 * min(times),
        "tokens_per_s": tps,
        "tflops": tps * flops / 1e12,
        "mfu": tps * flops / 1e12 / peak if peak else None,
        "peak_mem_gib": (
            (torch.cuda.max_memory_allocated(device) - base_mem) / 2**30
            if device.type == "cuda"
            else None
        ),
        "neox_overrides": extra,
        "variant": variant if impl == "neox" else "-",
        # Compiled graphs and graph breaks: the float8 casts must run inside the graphs.
        "compiled_graphs": dynamo["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(dynamo["graph_break"].values()),
        "num_layers": cfg.model.num_layers,
        # Host memory the run added (ZeRO-Offload's buffers), beside the estimate's count.
        "host_rss_added_gib": (rss_after - rss_before) / 2**30,
        "host_estimate_gib": estimated_host(cfg, vocab) / 2**30 if impl == "neox" else None,
    }
    if args.cprofile:
        rec["host_functions"] = host_profile(step, args.iters, device, args.cprofile)
    if args.sync_count:
        sites = count_syncs(step, args.iters, device)
        rec["syncs_per_step"] = sum(sites.values())
        rec["sync_sites"] = dict(sites.most_common(15))
    profile_variant = args.profile_variants is None or variant in args.profile_variants
    if (
        args.profile_dir
        and impl in args.profile_impls
        and model in args.profile_models
        and profile_variant
    ):
        name = f"{impl}_{model}" if attention == "config" else f"{impl}_{attention}_{model}"
        if variant != "bf16":
            name += f"_{variant}"
        rec["kernels"] = profile_steps(step, args.iters + 1, Path(args.profile_dir), name, device)
    close()
    del step, keep, close
    # ZeRO-3 replaces torch.nn.functional.linear for the process (DeepSpeed's memory-efficient
    # linear): put torch's back, or every later run of this process would use it.
    torch.nn.functional.linear = TORCH_LINEAR
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def print_table(records: list[dict[str, Any]]) -> None:
    print(
        f"{'model':>6} {'L':>3} {'impl':>10} {'variant':>14} {'attention':>9} {'mb':>3} "
        f"{'ms/step':>8} {'tok/s':>9} {'TFLOPS':>7} {'MFU':>6} {'memGiB':>7} {'syncs':>5}"
    )
    for r in records:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        print(
            f"{r['model']:>6} {r['num_layers']:>3} {r['impl']:>10} {r['variant']:>14} "
            f"{r['attention']:>9} {r['micro_batch']:>3} {r['step_ms']:>8.1f} "
            f"{r['tokens_per_s']:>9.0f} {r['tflops']:>7.1f} {mfu:>6} {mem:>7} "
            f"{r.get('syncs_per_step', '-'):>5}"
        )
    for r in records:
        if r.get("host_estimate_gib"):
            print(
                f"{r['model']} {r['variant']}: host memory added {r['host_rss_added_gib']:.1f} "
                f"GiB, estimated {r['host_estimate_gib']:.1f} GiB"
            )
    # Each variant against bf16 at the same shape and micro batch.
    shape = lambda r: (r["model"], r["num_layers"], r["micro_batch"])  # noqa: E731
    base = {shape(r): r["tokens_per_s"] for r in records if r["variant"] == "bf16"}
    for r in records:
        if r["variant"] not in ("bf16", "-") and shape(r) in base:
            ratio = r["tokens_per_s"] / base[shape(r)]
            print(f"{r['model']} mb {r['micro_batch']}: neox {r['variant']} / bf16 = {ratio:.2f}")
    records = [r for r in records if r["variant"] in ("bf16", "-")]
    by = {(r["model"], r["impl"], r["attention"]): r["tokens_per_s"] for r in records}
    for (model, impl, attention), tps in by.items():
        if impl != "neox":
            continue
        name = "neox" if attention == "config" else f"neox ({attention})"
        for ref in ("hf", "hf_compile"):
            if (model, ref, "sdpa") in by:
                print(f"{model}: {name} / {ref} = {tps / by[(model, ref, 'sdpa')]:.2f}")
        if attention == "triton" and (model, "neox", "flash") in by:
            flash = by[(model, "neox", "flash")]
            print(f"{model}: neox triton / flash attention = {tps / flash:.2f}")


# Long-context rows: name -> (micro batch, overrides). One document of 2k tokens per sample at
# micro batch 4 is the reference; longer rows keep ~8k+ tokens a step at micro batch 1, chunk
# the loss from 16k on (no (tokens, vocab) fp32 logits), and recompute a part of the activations where all
# would not fit (activation_memory_budget; `--neox-overrides '{"checkpoint_activations": true,
# "activation_memory_budget": 1}'` recomputes whole blocks instead).
# RoPE keeps the config's rotary_emb_base; max_position_embeddings grows with the sequence.
LONG_CONTEXT: dict[str, tuple[int, dict[str, Any]]] = {
    "2k": (4, {}),
    **{
        f"{k}k{suffix}": (
            1,
            {
                "seq_length": k * 1024,
                "max_position_embeddings": k * 1024,
                # At micro batch 1 the logits of 4k-8k tokens are no larger than the 2k row's
                # (4 x 2048): the loss stays compiled whole there (8k: 0.81x the 2k row against
                # 0.77x chunked, H100); chunked from 16k on, where they would be 3-6 GiB more.
                "lm_loss_chunk_size": 4096 if k >= 16 else 0,
                # Selective recompute in the compiled blocks where all activations would not
                # fit (32k: ~81 GiB): 1.28x the tokens/s of full-block checkpointing there.
                "activation_memory_budget": 0.75 if k >= 32 else 1.0,
                **({"reset_attention_mask": True, "reset_position_ids": True} if suffix else {}),
            },
        )
        for k in (4, 8, 16, 32)
        for suffix in ("", "_packed")
    },
}


def end_documents(text: torch.Tensor, eod: int, mean_length: int, seed: int) -> torch.Tensor:
    """`text` with EOD tokens at random, about one per `mean_length` tokens (packed documents)."""
    g = torch.Generator().manual_seed(seed)
    ends = (torch.rand(text.shape, generator=g) < 1 / mean_length).to(text.device)
    return torch.where(ends, torch.full_like(text, eod), text)


def run_long_context(args, device) -> list[dict[str, Any]]:
    """neox at each --long-context row on the first --models shape, against the first row."""
    records = []
    base = dict(json.loads(args.neox_overrides)) if args.neox_overrides else {}
    for name in args.long_context:
        micro_batch, overrides = LONG_CONTEXT[name]
        if args.tiny:  # CPU smoke: the same rows at 1/32 the length
            overrides = {
                **overrides,
                **{
                    key: overrides[key] // 32
                    for key in ("seq_length", "max_position_embeddings")
                    if key in overrides
                },
            }
        # Each row compiles its own shapes; one process's compile cache would otherwise hit
        # dynamo's recompile limit after a few rows and fall back to eager.
        torch._dynamo.reset()
        row = argparse.Namespace(**vars(args))
        row.micro_batch = args.micro_batch or micro_batch
        # --neox-overrides win over the row's keys (e.g. activation_memory_budget in place of
        # the 32k rows' checkpoint_activations).
        row.neox_overrides = json.dumps({**overrides, **base})
        rec = run_one(row, args.models[0], "neox", device)
        rec["long_context"] = name
        rec["doc_length"] = args.doc_length if overrides.get("reset_attention_mask") else None
        rec["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        records.append(rec)
        common.emit(rec, args.json)
    first = records[0]["tokens_per_s"]
    print(
        f"{'row':>10} {'seq':>6} {'mb':>3} {'ckpt':>4} {'tok/s':>9} {'MFU':>6} {'memGiB':>7} ratio"
    )
    for r in records:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        o = r["neox_overrides"]
        ckpt = "yes" if o.get("checkpoint_activations") else "no"
        if o.get("activation_memory_budget", 1) < 1:
            ckpt = f"sel{o['activation_memory_budget']}"  # selective: the compiled partition's
        print(
            f"{r['long_context']:>10} {r['seq']:>6} {r['micro_batch']:>3} {ckpt:>4} "
            f"{r['tokens_per_s']:>9.0f} {mfu:>6} {mem:>7} {r['tokens_per_s'] / first:.2f}"
        )
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MICRO_BATCH), default=DEFAULT_MODELS)
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=["bf16"],
        help="neox runs once per variant (fp8, ZeRO-3 and its options, ZeRO-3 + offload); "
        "each prints its ratio to bf16",
    )
    p.add_argument("--num-layers", type=int, default=None, help="a slice: fewer layers")
    p.add_argument("--impls", nargs="+", default=["neox", "hf", "hf_compile"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        help="micro batches per optimizer step (neox and HF alike; default 1)",
    )
    p.add_argument("--vocab-file", default=None, help="the 20B tokenizer json (HFTokenizer)")
    p.add_argument("--neox-overrides", default=None, help="JSON dict of extra neox config keys")
    p.add_argument(
        "--inductor",
        nargs="*",
        default=[],
        help="torch._inductor.config options, key=value, for every run of the process",
    )
    p.add_argument(
        "--attention",
        nargs="+",
        choices=["config", "flash", "triton", "torch"],
        default=["config"],
        help="neox runs once per attention_impl (config: as the config file selects)",
    )
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--sync-count", action="store_true", help="count host syncs of one step")
    p.add_argument("--cprofile", metavar="FILE", help="cProfile two steps; append the tables here")
    p.add_argument("--profile-dir", default=None)
    p.add_argument("--profile-impls", nargs="+", default=["neox"])
    p.add_argument("--profile-models", nargs="+", default=DEFAULT_MODELS)
    p.add_argument("--profile-variants", nargs="+", default=None, help="default: every one")
    p.add_argument("--json", default=None, help="append one JSON record per run here")
    p.add_argument("--tiny", action="store_true", help="2-layer model on CPU: a smoke test")
    p.add_argument(
        "--long-context",
        nargs="+",
        choices=list(LONG_CONTEXT),
        default=None,
        help="neox rows at these sequence lengths (the first is the reference), nothing else",
    )
    p.add_argument(
        "--doc-length", type=int, default=1024, help="mean document length of _packed rows"
    )
    args = p.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        args.iters, args.warmup = min(args.iters, 4), min(args.warmup, 1)
        if args.impls == p.get_default("impls"):
            args.impls = ["neox", "hf"]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    common.set_inductor_options(args.inductor)
    if args.long_context:
        run_long_context(args, device)
        return 0
    records = []
    runs = [
        (model, impl, attention, variant)
        for model in args.models
        for impl in args.impls
        for attention in (args.attention if impl == "neox" else ["config"])
        for variant in (args.variants if impl == "neox" else ["bf16"])
    ]
    for model, impl, attention, variant in runs:
        rec = run_one(args, model, impl, device, attention, variant)
        rec["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        records.append(rec)
        common.emit(rec, args.json)
    print_table(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
