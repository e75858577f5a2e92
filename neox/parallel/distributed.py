"""Joining the job's torch.distributed: the rank's environment from whichever launcher started
it, DeepSpeed's communication backend (gloo on CPU ranks), and the rank's device."""

import os

import torch

from neox.config import NeoXConfig
from neox.launcher.port import free_port
from neox.launcher.rank_env import rank_env_from_launcher


def init_distributed(cfg: NeoXConfig) -> torch.device:
    """torch.distributed through DeepSpeed: gloo on CPU ranks, the configured backend on GPUs."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    on_cpu = accel.device_name() == "cpu"
    backend = "gloo" if on_cpu else cfg.parallel.distributed_backend
    os.environ.update(rank_env_from_launcher(cfg.launcher, os.environ))
    if "RANK" not in os.environ:
        # A plain `python train.py cfg.yml` is a one-rank job.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(cfg.launcher.master_port or free_port()))
    start_deepspeed_comm(backend)
    if on_cpu:
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accel.set_device(local_rank)
    return torch.device(accel.device_name(), local_rank)


def start_deepspeed_comm(backend: str) -> None:
    """deepspeed.init_distributed, compiling nothing.

    DeepSpeed's torch backend JIT-compiles a shared-memory all-reduce (a C++ op: a compiler
    needed, minutes on a first CPU launch, again whenever the extension cache is not shared)
    as it starts, for its `inference_all_reduce` alone, which neox never calls. Marked
    unbuildable in DeepSpeed's table of compatible ops, it is never built and every collective
    is torch's (gloo on CPU ranks). The table is the only one of DeepSpeed's that runtime code
    reads, for that op alone; left unset until then, its first read would probe every op,
    test-compiling C files."""
    import deepspeed
    import deepspeed.ops

    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)
