"""Launcher settings: where the ranks run and how they are started (an agent per node)."""

import re
from typing import Annotated, Literal, Optional

from pydantic import Field, field_validator

from neox.config.base import MAX_RANKS, ConfigGroup, Reads


class LauncherConfig(ConfigGroup):
    """How deepy.py starts the ranks: local processes, or a hostfile over pdsh/ssh, MPI or slurm."""

    hostfile: Annotated[Optional[str], Reads("neox/launcher/plan.py")] = None
    """Hostfile of `host slots=N` lines; none means one node with all local GPUs (or CPU ranks)."""

    include: Annotated[Optional[str], Reads("neox/launcher/plan.py")] = None
    """Hosts and slots to use, DeepSpeed syntax: `host1:0,1@host2`."""

    exclude: Annotated[Optional[str], Reads("neox/launcher/plan.py")] = None
    """Hosts and slots to leave out, DeepSpeed syntax: `host1:0@host2`."""

    num_nodes: Annotated[int, Reads("neox/launcher/plan.py")] = Field(-1, ge=-1, le=MAX_RANKS)
    """Number of nodes to use from the hostfile (-1: all)."""

    num_gpus: Annotated[Optional[int], Reads("neox/launcher/plan.py")] = Field(None, ge=1, le=1024)
    """Processes per node: GPUs to use, or CPU ranks on a machine without a GPU (None: all GPUs, 1 CPU rank)."""

    master_addr: Annotated[Optional[str], Reads("neox/launcher/plan.py")] = None
    """Address of rank 0 (default: the first host of the hostfile, or localhost)."""

    master_port: Annotated[
        Optional[int], Reads("neox/launcher/plan.py", "neox/parallel/distributed.py")
    ] = Field(None, ge=1, le=65535)
    """Port of rank 0's rendezvous (None: a free port on one node, 29500 across nodes)."""

    launcher: Annotated[
        Literal["pdsh", "openmpi", "mvapich", "slurm"], Reads("neox/launcher/plan.py")
    ] = "pdsh"
    """Multi-node launcher: pdsh (an ssh per node), or mpirun/srun starting neox's agent on each
    node."""

    force_multi: Annotated[bool, Reads("neox/launcher/plan.py")] = False
    """Use the multi-node launcher even for one node."""

    no_ssh_check: Annotated[bool, Reads("neox/launcher/plan.py")] = False
    """Skip the ssh login to every node before an openmpi/mvapich launch (as DeepSpeed's runner's
    check; pdsh launches always check, slurm ones never do)."""

    ssh_port: Annotated[Optional[int], Reads("neox/launcher/plan.py")] = Field(None, ge=1, le=65535)
    """sshd port on the nodes, when not 22."""

    detect_nvlink_pairs: bool = False
    """No-op (gpt-neox key): an autotuning helper of gpt-neox's launcher."""

    comment: Annotated[Optional[str], Reads("neox/launcher/plan.py")] = None
    """Slurm comment (slurm launcher only)."""

    account: Annotated[Optional[str], Reads("neox/launcher/plan.py")] = None
    """Slurm account (slurm launcher only)."""

    deepspeed_mpi: Annotated[bool, Reads("neox/launcher/rank_env.py")] = False
    """Ranks take their rank and world size from MPI's environment (OMPI_COMM_WORLD_*); implied by
    launcher openmpi or mvapich."""

    deepspeed_slurm: Annotated[bool, Reads("neox/launcher/rank_env.py")] = False
    """Ranks take their rank and world size from slurm's environment (SLURM_PROCID, ...); implied
    by launcher slurm."""

    export_env: Annotated[list[str], Reads("neox/launcher/plan.py")] = []
    """Extra environment variable names exported to every node (besides PYTHONPATH, NCCL_*, DS_*...)."""

    stop_grace_s: Annotated[float, Reads("neox/launcher/plan.py")] = Field(600.0, ge=0, le=86400)
    """Seconds the ranks get to save and exit after a stop (SIGTERM/SIGINT to deepy.py, or
    deepy.py gone) before the node's agent kills them; a large model's save takes minutes."""

    max_restarts: Annotated[int, Reads("neox/launcher/restart.py")] = Field(0, ge=0, le=1000)
    """Times deepy.py relaunches train.py after a failure (0: never): a rank that dies (a crash,
    the OOM killer, a collective timing out), hangs (`hang_timeout_s`), or a node lost (its ssh
    session or agent gone). Every rank on every node is ended first; the relaunch resumes from
    the newest good checkpoint in `save` (which it needs). Never restarted: a stop signal (the
    ranks save and exit), an error a relaunch would meet again (a config or checkpoint error,
    non-finite steps: the ranks exit 2), and scripts other than train.py."""

    hang_timeout_s: Annotated[Optional[float], Reads("neox/launcher/plan.py")] = Field(
        None, gt=0, le=604800
    )
    """Seconds without a finished training step after which a node's agent takes a rank for
    hung and kills the ranks (a failure: restarted under `max_restarts`). Timed from each rank's
    first finished step, so building, compiling and loading a checkpoint are not; an evaluation
    or a save is, so set it above the longest of those and of a step. None: off."""

    skip_memory_check: Annotated[bool, Reads("neox/plan/report.py")] = False
    """Launch even when the memory estimate (tools/estimate.py) is over twice what each rank has
    (GPU memory, or host memory per CPU rank); deepy.py refuses such a launch otherwise."""

    @field_validator("num_nodes")
    @classmethod
    def _some_nodes(cls, v: int) -> int:
        if v == 0:
            raise ValueError(f"num_nodes={v} must be >= 1, or -1 for every host")
        return v

    @field_validator("export_env")
    @classmethod
    def _variable_names(cls, v: list[str]) -> list[str]:
        bad = [n for n in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)]
        if bad:
            raise ValueError(
                f"export_env names {bad} are not environment variable names (letters, digits "
                "and '_', not starting with a digit)"
            )
        return v
