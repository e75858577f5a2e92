"""Launcher settings: where the ranks run and how they are started (DeepSpeed's runner)."""

import re
from typing import Literal, Optional

from pydantic import model_validator

from neox.config.base import ConfigGroup


class LauncherConfig(ConfigGroup):
    """How deepy.py starts the ranks: local processes, or a hostfile over pdsh/ssh, MPI or slurm."""

    hostfile: Optional[str] = None
    """Hostfile of `host slots=N` lines; none means one node with all local GPUs (or CPU ranks)."""

    include: Optional[str] = None
    """Hosts and slots to use, DeepSpeed syntax: `host1:0,1@host2`."""

    exclude: Optional[str] = None
    """Hosts and slots to leave out, DeepSpeed syntax: `host1:0@host2`."""

    num_nodes: int = -1
    """Number of nodes to use from the hostfile (-1: all)."""

    num_gpus: Optional[int] = None
    """Processes per node: GPUs to use, or CPU ranks on a machine without a GPU (None: all GPUs, 1 CPU rank)."""

    master_addr: Optional[str] = None
    """Address of rank 0 (default: the first host of the hostfile, or localhost)."""

    master_port: Optional[int] = None
    """Port of rank 0's rendezvous (None: a free port on one node, 29500 across nodes)."""

    launcher: Literal["pdsh", "openmpi", "mvapich", "slurm"] = "pdsh"
    """Multi-node launcher handed to DeepSpeed's runner."""

    force_multi: bool = False
    """Use the multi-node launcher even for one node."""

    no_ssh_check: bool = False
    """Skip DeepSpeed's passwordless-ssh check before a multi-node launch."""

    ssh_port: Optional[int] = None
    """sshd port on the nodes, when not 22."""

    detect_nvlink_pairs: bool = False
    """No-op (gpt-neox key): an autotuning helper of gpt-neox's launcher."""

    comment: Optional[str] = None
    """Slurm comment (slurm launcher only)."""

    account: Optional[str] = None
    """Slurm account (slurm launcher only)."""

    deepspeed_mpi: bool = False
    """Ranks take their rank and world size from MPI's environment (OMPI_COMM_WORLD_*); implied by
    launcher openmpi or mvapich."""

    deepspeed_slurm: bool = False
    """Ranks take their rank and world size from slurm's environment (SLURM_PROCID, ...); implied
    by launcher slurm."""

    export_env: list[str] = []
    """Extra environment variable names exported to every node (besides PYTHONPATH, NCCL_*, DS_*...)."""

    stop_grace_s: float = 600.0
    """Seconds the ranks get to save and exit after a stop (SIGTERM/SIGINT to deepy.py, or
    deepy.py gone) before the node's agent kills them; a large model's save takes minutes."""

    @model_validator(mode="after")
    def _check_counts(self) -> "LauncherConfig":
        if self.num_gpus is not None and self.num_gpus < 1:
            raise ValueError(f"num_gpus={self.num_gpus} must be >= 1 (or left unset for all GPUs)")
        if self.stop_grace_s < 0:
            raise ValueError(f"stop_grace_s={self.stop_grace_s} must be >= 0 (seconds)")
        if self.num_nodes == 0 or self.num_nodes < -1:
            raise ValueError(f"num_nodes={self.num_nodes} must be >= 1, or -1 for every host")
        bad = [n for n in self.export_env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)]
        if bad:
            raise ValueError(
                f"export_env names {bad} are not environment variable names (letters, digits "
                "and '_', not starting with a digit)"
            )
        return self
