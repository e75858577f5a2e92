"""Start the ranks: hostfile and include/exclude parsing, a neox agent per node (the ranks' parent),
env export; DeepSpeed's runner for mpirun/srun."""

from neox.launcher.hostfile import (
    HostfileError,
    LaunchError,
    parse_hostfile,
    read_hostfile,
    select_resources,
)
from neox.launcher.plan import LaunchPlan, build_launch
from neox.launcher.run import LaunchResult, launch

__all__ = [
    "HostfileError",
    "LaunchError",
    "LaunchPlan",
    "LaunchResult",
    "build_launch",
    "launch",
    "parse_hostfile",
    "read_hostfile",
    "select_resources",
]
