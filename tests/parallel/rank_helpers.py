"""Start real gloo ranks on this machine for the parallel tests."""

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from neox.parallel.distributed import start_deepspeed_comm
from tests.port_helpers import free_port

# Ranks are forked from a server process that imported these once, so a rank starts without
# importing torch and DeepSpeed afresh. Not forked from pytest itself: a child of a process that
# has run OpenMP work can hang in its own. torch._dynamo too: every torch optimizer imports it
# (2-3 s) as it is built, in each rank otherwise.
RANKS = multiprocessing.get_context("forkserver")
RANKS.set_forkserver_preload(
    ["deepspeed", "neox.training.loop", "tests.train_helpers", "torch._dynamo"]
)


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    start_deepspeed_comm("gloo")  # before a DeepSpeed engine starts it, compiling its shm op
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run fn(rank, world, *args) on `world` gloo ranks; a failing rank fails the caller."""
    mp.start_processes(
        _entry, args=(world, free_port(), fn, args), nprocs=world, start_method="forkserver"
    )
