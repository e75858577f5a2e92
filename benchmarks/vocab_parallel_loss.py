"""One-GPU micro-benchmark: output layer + vocab-parallel cross-entropy, forward + backward.

(a) before: the eager autograd.Function neox ran until the loss became plain ops (a copy below);
(b) neox.parallel.layers.sharded_cross_entropy run eagerly;
(c) the same compiled together with the head matmul, as compile_blocks compiles the loss.

    python benchmarks/vocab_parallel_loss.py            # 4096 tokens x 25216 vocab shard, 6144 hidden, bf16
    python benchmarks/vocab_parallel_loss.py --tokens 64 --hidden 32 --vocab-shard 96 \\
        --dtype fp32 --iters 2 --warmup 1                # CPU smoke run

The process group has one rank (nccl on CUDA, gloo on CPU). The loss functions are called
directly, not through vocab_parallel_cross_entropy, whose one-rank shortcut is F.cross_entropy:
the vocab-parallel math runs, its all-reduces over one rank. The defaults are configs/20B.yml's
last stage at TP=2, micro batch 2. Differences are against (a): the mean loss, and the hidden
states' and the head weight's gradients.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from neox.parallel.layers import sharded_cross_entropy  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class BeforeVocabParallelCrossEntropy(torch.autograd.Function):
    """BEFORE-VERSION, kept here only for comparison: neox's eager vocab-parallel cross-entropy
    (neox/parallel/layers.py before the plain-op rewrite). In-place all-reduces, an fp32
    softmax saved for backward, every pass its own kernel."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
        per_rank = logits.shape[-1]
        start = dist.get_rank(group=group) * per_rank
        z = logits.float()
        z_max = z.max(dim=-1).values
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        z = z - z_max.unsqueeze(-1)
        local = target - start
        outside = (local < 0) | (local >= per_rank)
        local = local.masked_fill(outside, 0)
        z_target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(z_target, group=group)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local, outside)
        ctx.in_dtype = logits.dtype
        return sum_exp.log() - z_target

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        return (g * grad.unsqueeze(-1)).to(ctx.in_dtype), None, None


def head_and_loss(loss: Callable[..., torch.Tensor], group: Any) -> Callable[..., torch.Tensor]:
    def step(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss(F.linear(h, w), target, group).mean()

    return step


def measure(fn: Callable[..., torch.Tensor], args: argparse.Namespace, inputs: tuple) -> dict:
    """ms per forward + backward (median), peak memory above the inputs, loss and gradients."""
    h, w, target = inputs
    cuda = h.is_cuda

    def once() -> torch.Tensor:
        h.grad = w.grad = None
        loss = fn(h, w, target)
        loss.backward()
        return loss

    for _ in range(args.warmup):
        once()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(args.iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = once()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            tick = time.perf_counter()
            loss = once()
            times.append(1e3 * (time.perf_counter() - tick))
    peak = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f}" if cuda else "-"
    return dict(
        ms=sorted(times)[len(times) // 2],
        peak_mib=peak,
        loss=loss.detach().float(),
        dh=h.grad.float(),
        dw=w.grad.float(),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--vocab-shard", type=int, default=25216)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--backend", default="inductor", help="torch.compile backend for (c)")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    device, dtype = torch.device("cuda" if cuda else "cpu"), DTYPES[args.dtype]
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=g)
    w = torch.randn(args.vocab_shard, args.hidden, device=device, dtype=dtype, generator=g)
    w /= args.hidden**0.5  # logits of unit scale
    target = torch.randint(0, args.vocab_shard, (args.tokens,), device=device, generator=g)
    inputs = (h.requires_grad_(), w.requires_grad_(), target)

    group = dist.group.WORLD
    new = head_and_loss(sharded_cross_entropy, group)
    variants = {
        "(a) before: eager autograd.Function": head_and_loss(
            BeforeVocabParallelCrossEntropy.apply, group
        ),
        "(b) plain ops, eager": new,
        f"(c) plain ops + head, torch.compile({args.backend})": torch.compile(
            new, backend=args.backend
        ),
    }
    print(
        f"tokens {args.tokens}, hidden {args.hidden}, vocab shard {args.vocab_shard}, "
        f"{args.dtype}, {device.type}; {args.warmup} warmup + {args.iters} iters"
    )
    print("| variant | ms / iter | peak MiB | max abs d loss | d grad h | d grad w |")
    print("|---|---:|---:|---:|---:|---:|")
    ref = None
    for name, fn in variants.items():
        r = measure(fn, args, inputs)
        ref = r if ref is None else ref
        diffs = [(r[k] - ref[k]).abs().max().item() for k in ("loss", "dh", "dw")]
        print(
            f"| {name} | {r['ms']:.3f} | {r['peak_mib']} | "
            + " | ".join(f"{d:.2e}" for d in diffs)
            + " |",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
