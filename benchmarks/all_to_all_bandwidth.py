"""What one all_to_all_single costs on this machine's GPUs, at the sizes expert and context
parallelism send: the floor under their exchange time in a profile (issues 37, 38).

    torchrun --nproc-per-node 4 benchmarks/all_to_all_bandwidth.py

Each case times `--iters` exchanges of a (rows, width) bf16 tensor after 3 warm-up ones, every
rank sending rows / ranks rows to each rank (or, with `uneven`, a random split like an MoE
router's), and prints per rank the milliseconds per exchange and the GB/s leaving the rank (its
rows for the other ranks). Not a training run: it measures the collective alone, which a
profile's NCCL kernel time includes along with waiting for slower ranks.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

# EP=4, OLMoE-1B-7B at micro batch 8 x 4,096: ~3.66 rows a token over 32,768 tokens; CP=4 at
# 32k and 128k (Pythia-1.4B, q, k and v of 2,048 packed: 6,144 wide, a quarter of the tokens).
CASES = {
    "ep4_dispatch": (120_000, 2048, True),
    "cp4_32k_qkv": (8192, 6144, False),
    "cp4_128k_qkv": (32768, 6144, False),
}


def splits(rows: int, world: int, uneven: bool) -> torch.Tensor:
    """(world, world): rows rank s sends rank d, the same on every rank (seeded)."""
    if not uneven:
        return torch.full((world, world), rows // world, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(0, world * world, (rows * world,), generator=g)
    return picks.bincount(minlength=world * world).view(world, world)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = p.parse_args()
    cuda = torch.cuda.is_available()  # gloo on CPU ranks: a check of the script, not a figure
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in args.cases:
        rows, width, uneven = CASES[name]
        table = splits(rows, world, uneven)
        send, recv = table[rank].tolist(), table[:, rank].tolist()
        x = torch.randn(sum(send), width, device=device, dtype=torch.bfloat16)
        out = x.new_empty(sum(recv), width)
        for _ in range(3):
            dist.all_to_all_single(out, x, recv, send)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        tick = time.perf_counter()
        for _ in range(args.iters):
            dist.all_to_all_single(out, x, recv, send)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - tick) / args.iters
        leaving = (sum(send) - send[rank]) * width * x.element_size()
        line = (
            f"{name} rank {rank}: {sum(send)} x {width} rows, {seconds * 1e3:.3f} ms an exchange, "
            f"{leaving / 1e9:.3f} GB leave the rank: {leaving / seconds / 1e9:.1f} GB/s"
        )
        for r in range(world):
            if r == rank:
                print(line, flush=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
