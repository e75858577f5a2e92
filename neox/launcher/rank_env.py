"""Rank placement for ranks that mpirun or srun start: torch's names from the launcher's."""

from collections.abc import Mapping

from neox.config.launcher import LauncherConfig

# Where mpirun and srun put each rank's place: (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE).
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


def rank_env_from_launcher(lc: LauncherConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK for ranks started by mpirun or srun, which set their own names.

    DeepSpeed's runner sets torch's names only for pdsh and local launches; gpt-neox's
    deepspeed_mpi/deepspeed_slurm ask for this translation, and the launcher key implies it.
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
