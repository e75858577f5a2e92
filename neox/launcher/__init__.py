"""Start the ranks: hostfile and include/exclude parsing, a neox agent per node (the ranks' parent;
started here, over ssh, or by mpirun/srun), env export."""

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
