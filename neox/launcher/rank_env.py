"""Rank placement for ranks that mpirun or srun start themselves (a user's own mpirun/srun of
train.py; deepy.py's agents set torch's names): torch's names from the launcher's."""

from collections.abc import Mapping

from neox.config.launcher import LauncherConfig
from neox.launcher.process import LAUNCHER_RANK_ENV


def rank_env_from_launcher(lc: LauncherConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK for ranks started by mpirun or srun, which set their own names.

    gpt-neox's deepspeed_mpi/deepspeed_slurm ask for this translation, and the launcher key
    implies it. Ranks of a deepy.py launch have RANK from their agent.
    """
    if "RANK" in environ:
        return {}
    kinds = []
    if lc.deepspeed_slurm or lc.launcher == "slurm":
        kinds.append("slurm")
    if lc.deepspeed_mpi or lc.launcher in ("openmpi", "mvapich"):
        kinds += ["mpi", "mvapich"]
    for kind in kinds:
        names = LAUNCHER_RANK_ENV[kind]
        if names[0] in environ:
            values = {
                torch_name: environ[name]
                for torch_name, name in zip(
                    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), names
                )
                if name and name in environ
            }
            values.setdefault("MASTER_PORT", str(lc.master_port))
            return values
    return {}
