"""What deepy.py and the agents share about processes: dying with one's parent, naming how a rank
ended, and what ranks leave behind."""

import ctypes
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPORT_PREFIX = "neox-agent-report "
# A rank's exit status for an error a relaunch would meet again (a config, data or checkpoint
# error, non-finite steps); deepy.py's own for a config error before launch. Never restarted.
INPUT_ERROR_EXIT = 2
# An agent that mpirun or srun started says so once its ranks exist: a stop passed on before
# then could end it before it can pass the stop on to its ranks.
READY_PREFIX = "neox-agent-ready "
# Where mpirun and srun put each process's place: (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE).
LAUNCHER_RANK_ENV = {
    "mpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "mvapich": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", ""),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
}
_PR_SET_PDEATHSIG = 1
# Loaded before any thread starts: a child between fork and exec must not load libraries.
_LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent(sig: int, parent_pid: int) -> None:
    """Ask the kernel to send `sig` to this process when its parent ends; if the parent ended
    already (between fork and this call), act on it now. Survives exec (not setuid programs)."""
    if _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def child_dies_with_me(sig: int):
    """A Popen preexec_fn: the child receives `sig` when this process ends."""
    me = os.getpid()
    return lambda: die_with_parent(sig, me)


@dataclass
class RankExit:
    rank: int
    pid: int
    host: str
    status: int  # wait status as the kernel reports it
    tail: list[str] = field(default_factory=list)  # last lines of its stderr, when teed
    killed_by_agent: Optional[str] = None  # why its agent killed it, if it did

    def describe(self) -> str:
        if self.killed_by_agent:
            how = f"was killed by its agent ({self.killed_by_agent})"
        elif self.status & 0x7F:
            sig = self.status & 0x7F
            name = {s.value: s.name for s in signal.Signals}.get(sig, "a real-time signal")
            how = f"was killed by {name} (signal {sig}"
            how += "; the kernel's OOM killer sends SIGKILL)" if sig == signal.SIGKILL else ")"
        else:
            how = f"exited with status {self.status >> 8}"
        return f"rank {self.rank} on {self.host} (pid {self.pid}) {how}"

    @property
    def exit_code(self) -> int:
        """The status a shell would report for it."""
        return 128 + (self.status & 0x7F) if self.status & 0x7F else self.status >> 8


def remove_shm_buffers(master_port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves a 69 MB buffer per rank in /dev/shm, named by the uid,
    master address and port, and never removes it: runs on free ports would fill the memory."""
    for path in Path("/dev/shm").glob(
        f"deepspeed_allreduce_buffer_{os.getuid()}_*_{master_port}_*"
    ):
        path.unlink(missing_ok=True)
