"""Plan a launch: an agent per node (started here, over ssh, or by mpirun/srun), its environment
and what reaches the nodes."""

import logging
import os
import re
import shlex
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from neox.config.launcher import LauncherConfig
from neox.launcher.hostfile import HostfileError, LaunchError, read_hostfile, select_resources
from neox.launcher.liveness import RESTART_ENV
from neox.launcher.port import DEFAULT_MASTER_PORT, free_port
from neox.launcher.ssh import remote_command, ssh_argv

log = logging.getLogger(__name__)

# DeepSpeed's runner reads /job/hostfile when given none (its DLTS default); we honour the same file.
DEFAULT_HOSTFILE = "/job/hostfile"
# Variables exported to nodes by prefix, as DeepSpeed's runner does (runner.EXPORT_ENVS plus the
# CUDA accelerator's NCCL), and our DS_ for DS_ACCELERATOR and friends.
EXPORT_PREFIXES = ("PYTHON", "MLFLOW", "MV2", "UCX", "NCCL", "DS_")
# Tags every process of one launch (inherited through the environment), so a watchdog can end
# exactly those on every node without matching other jobs by name.
LAUNCH_ID_ENV = "NEOX_LAUNCH_ID"
# Where each launcher tells a process its place (the first set of a list); with one process per
# node, the node rank. Open MPI's mpirun, MVAPICH2's (or a hydra mpirun's PMI), and srun's.
NODE_RANK_ENV = {
    "openmpi": "OMPI_COMM_WORLD_RANK",
    "mvapich": "MV2_COMM_WORLD_RANK,PMI_RANK",
    "slurm": "SLURM_NODEID",
}
NEOX_ROOT = str(Path(__file__).resolve().parents[2])
# A host name or address that means the same to a shell quoted or not, and is no option.
_PLAIN = re.compile(r"^(?!-)[\w@%+=:,./-]*$")


@dataclass
class LaunchPlan:
    """Everything launch() needs, and what --dry-run shows: commands, environment, layout."""

    argvs: list[list[str]]
    """The processes deepy.py starts: one neox agent per node (itself for this machine, through
    ssh for the others), or mpirun/srun, which start one agent per node."""
    env: dict[str, str]
    """Full environment of those processes."""
    exports: dict[str, str]
    """Variables set on every node (in the ssh command, or named to mpirun -x / srun --export)."""
    hosts: dict[str, list[int]]
    """Active hosts and their slot ids, in rank order."""
    world_size: int
    """Total number of ranks."""
    launcher: str
    """'local' (one node, no ssh), 'pdsh' (an agent per node over ssh), or openmpi/mvapich/slurm
    (mpirun or srun starts the agent on each node)."""
    cwd: str
    """Working directory of the agents and the ranks on every node."""
    launch_id: str
    """Unique tag of this launch, set as NEOX_LAUNCH_ID in every rank's environment."""
    master_port: int
    """Port of rank 0's rendezvous."""
    stop_grace_s: float
    """Seconds the ranks get to save after a stop before they are killed."""
    ssh_port: Optional[int] = None
    """sshd port of the nodes."""
    ssh_check: bool = False
    """Log into every node over ssh before the launch (pdsh; mpirun's too, unless no_ssh_check)."""
    cpu: bool = False
    """Ranks run on CPU (DS_ACCELERATOR=cpu, gloo)."""
    script_args: list[str] = field(default_factory=list)
    """The entry script and its arguments, as every rank gets them."""
    command: str = field(init=False)
    """The commands as shell-safe lines, for --dry-run."""

    def __post_init__(self) -> None:
        self.command = "\n".join(shlex.join(argv) for argv in self.argvs)

    @property
    def multi_node(self) -> bool:
        """True when the ranks are started on other nodes (ssh, mpirun, srun)."""
        return self.launcher != "local"

    @property
    def agents_by_launcher(self) -> bool:
        """True when mpirun or srun starts the agents (one process deepy.py starts, told to stop
        by a signal it passes on), not deepy.py itself or ssh."""
        return self.launcher in NODE_RANK_ENV


def build_launch(
    cfg: LauncherConfig,
    script: str,
    script_args: list[str],
    *,
    cpu: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
) -> LaunchPlan:
    """Plan a launch of `script script_args...` on every rank; raises before anything starts.

    Args:
        cpu: run CPU ranks (None: when DS_ACCELERATOR=cpu or this machine has no GPU).
        environ: environment to start from (default: os.environ).
        cwd: working directory of the launch (default: the current one).
    """
    environ = dict(os.environ if environ is None else environ)
    cwd = os.path.abspath(cwd or os.getcwd())
    if cpu is None:
        cpu = _runs_on_cpu(environ)
    hostfile = _hostfile(cfg, environ)
    launch_id = uuid.uuid4().hex
    env = dict(environ)
    env[LAUNCH_ID_ENV] = launch_id
    env["PYTHONPATH"] = neox_pythonpath(environ.get("PYTHONPATH", ""))
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    env.pop("DS_ENV_FILE", None)  # read here (user_env_file_exports); no rank needs it
    common = dict(launch_id=launch_id, stop_grace_s=cfg.stop_grace_s, cpu=cpu)
    common["script_args"] = [script, *script_args]

    if hostfile is None:
        hosts = _local_resources(cfg, cpu, environ)
        port = cfg.master_port or free_port()
        if cfg.master_addr:
            log.warning(
                "WARNING: master_addr=%s is not used: without a hostfile every rank runs on this "
                "machine and meets at 127.0.0.1; give a hostfile to place rank 0 elsewhere",
                _plain_master_addr(cfg.master_addr),
            )
        exports = {k: env[k] for k in _export_names(cfg, env)}
        argv = _agent_argv(cfg, hosts, 0, "127.0.0.1", port, [script, *script_args])
        return LaunchPlan(
            [argv], env, exports, hosts, _count(hosts), "local", cwd, master_port=port, **common
        )

    pool = read_hostfile(hostfile)
    num_nodes = cfg.num_nodes
    hosts = select_resources(pool, cfg.include, cfg.exclude, num_nodes, cfg.num_gpus, hostfile)
    multi = cfg.force_multi or len(hosts) > 1
    launcher = cfg.launcher if multi else "local"
    _check_backend_filters(cfg)
    _slurm_args(cfg)  # refuses comment/account on other launchers
    mpi = launcher in NODE_RANK_ENV
    # gpt-neox's ranks started by mpirun or srun meet at MASTER_ADDR/MASTER_PORT when set.
    master_addr = cfg.master_addr or (environ.get("MASTER_ADDR") if mpi else None)
    if master_addr is None:
        # The first host is rank 0's; a one-node launch meets on this machine.
        master_addr = next(iter(hosts)) if multi else "127.0.0.1"
    master_addr = _plain_master_addr(master_addr)
    port = cfg.master_port or (_env_port(environ) if mpi else None)
    port = port or (DEFAULT_MASTER_PORT if multi else free_port())
    exports = {k: env[k] for k in _export_names(cfg, env)}
    if launcher == "local":
        [slots] = hosts.values()
        argv = _agent_argv(cfg, {"localhost": slots}, 0, "127.0.0.1", port, [script, *script_args])
        return LaunchPlan(
            [argv], env, exports, hosts, _count(hosts), "local", cwd, master_port=port, **common
        )
    user_exports = _user_env_file_exports(environ, cwd)
    if launcher == "pdsh":
        all_exports = {**user_exports, **exports}
        argvs = [
            ssh_argv(host, cfg.ssh_port, env)
            + [
                remote_command(
                    cwd,
                    all_exports,
                    _agent_argv(cfg, hosts, node, master_addr, port, [script, *script_args], True),
                )
            ]
            for node, host in enumerate(hosts)
        ]
        return LaunchPlan(
            argvs,
            env,
            exports,
            hosts,
            _count(hosts),
            launcher,
            cwd,
            master_port=port,
            ssh_port=cfg.ssh_port,
            ssh_check=True,
            **common,
        )

    # mpirun, mpiexec (hydra) or srun start one agent per node, which starts the node's ranks.
    if launcher == "slurm":
        _check_same_slots(hosts)
    env.update({**user_exports, **exports})  # the launcher passes these, by name, to every node
    if launcher == "openmpi":
        # Open MPI 4.1's daemons map a copy of the hardware topology for MPI processes into the
        # largest gap of their address space and, now and then, segfault writing it
        # (docs/launcher.md). neox's agents never call MPI_Init, so nothing reads that copy.
        env.setdefault("OMPI_MCA_rtc_hwloc_vmhole", "none")
    names = [*dict.fromkeys([*user_exports, *exports])]
    argv = _launcher_argv(cfg, launcher, hosts, names, cpu)
    argv += _agent_argv(cfg, hosts, None, master_addr, port, [script, *script_args], True, launcher)
    return LaunchPlan(
        [argv],
        env,
        {**user_exports, **exports},
        hosts,
        _count(hosts),
        launcher,
        cwd,
        master_port=port,
        ssh_port=cfg.ssh_port,
        # mpirun reaches the nodes over ssh, as DeepSpeed's runner checked; srun does not.
        ssh_check=launcher != "slurm" and not cfg.no_ssh_check,
        **common,
    )


def _launcher_argv(
    cfg: LauncherConfig, launcher: str, hosts: dict[str, list[int]], exports: list[str], cpu: bool
) -> list[str]:
    """mpirun or srun starting one process per node, with `exports` (names set in its own
    environment) passed to every node; the agent's command follows."""
    nodes = str(len(hosts))
    if launcher == "openmpi":
        # The hosts in plan order, one process each; no core binding: the ranks inherit it.
        argv = ["mpirun", "-n", nodes, "--host", ",".join(hosts), "--map-by", "ppr:1:node"]
        argv += ["--bind-to", "none"]
        return argv + [arg for name in exports for arg in ("-x", name)] + ["--"]
    if launcher == "mvapich":
        argv = ["mpirun", "-np", nodes, "-ppn", "1", "-hosts", ",".join(hosts)]
        return argv + ["-genvlist", ",".join(exports)]
    # srun numbers nodes in slurm's own order: every host has the same slots (checked). Like
    # mpirun, it ends the step when an agent fails (one that fails before it can report, too).
    argv = ["srun", "-n", nodes, "--nodes", nodes, "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if cfg.include or cfg.exclude:
        argv += ["--nodelist", ",".join(hosts)]
    if cfg.num_gpus is not None and not cpu:
        argv += ["--gpus-per-node", str(cfg.num_gpus)]
    argv += _slurm_args(cfg)
    return argv + ["--export=" + ",".join(["ALL", *exports]), "--"]


def _check_same_slots(hosts: dict[str, list[int]]) -> None:
    if len({tuple(slots) for slots in hosts.values()}) > 1:
        listed = ", ".join(f"{h}: {','.join(map(str, s))}" for h, s in hosts.items())
        raise HostfileError(
            f"launcher=slurm needs the same slots on every host, got {listed}; srun numbers the "
            "nodes in its own order, so edit the hostfile (or include/exclude) to match, or "
            "use launcher: pdsh"
        )


def _hostfile(cfg: LauncherConfig, environ: Mapping[str, str]) -> Optional[str]:
    """The hostfile to use: the config's, else gpt-neox's DLTS_HOSTFILE, else DeepSpeed's
    /job/hostfile when it exists; None for this machine only."""
    hostfile, key = cfg.hostfile, "launcher.hostfile"
    if hostfile is None and environ.get("DLTS_HOSTFILE"):
        hostfile, key = environ["DLTS_HOSTFILE"], "DLTS_HOSTFILE"
    if hostfile is not None and os.path.isdir(hostfile):
        raise HostfileError(
            f"{key}={hostfile} is a directory; point it at a file of `host slots=N` lines"
        )
    if hostfile is not None and not os.path.isfile(hostfile):
        # gpt-neox's stock configs carry `hostfile: /mock_path`; DeepSpeed's runner reads a
        # missing hostfile as "run on this machine only", and so do we, loudly.
        log.warning(
            "WARNING: %s %s does not exist: running on this machine only (as DeepSpeed's "
            "runner does); unset it or point it at a real file to use other nodes",
            key,
            hostfile,
        )
        return None
    if hostfile is None and os.path.isfile(DEFAULT_HOSTFILE):
        log.info("no launcher.hostfile set; using %s as DeepSpeed's runner would", DEFAULT_HOSTFILE)
        return DEFAULT_HOSTFILE
    return hostfile


def _agent_argv(
    cfg: LauncherConfig,
    hosts: dict[str, list[int]],
    node: Optional[int],
    master_addr: str,
    port: int,
    script_args: list[str],
    remote: bool = False,
    launcher: str = "pdsh",
) -> list[str]:
    """The agent's command. `node` None: mpirun/srun start the same command on every node, which
    learns its node rank from the launcher and takes its slots from every node's list. A remote
    agent relays the ranks' output (and survives its connection ending)."""
    slots = list(hosts.values())
    if node is None:
        place = [f"--node_rank_env={NODE_RANK_ENV[launcher]}"]
        devices = "/".join(",".join(map(str, s)) for s in slots)
    else:
        place = [f"--node_rank={node}"]
        devices = ",".join(map(str, slots[node]))
    return [
        sys.executable,
        "-u",
        "-m",
        "neox.launcher.agent",
        *place,
        f"--nodes={','.join(str(len(s)) for s in slots)}",
        f"--devices={devices}",
        f"--master_addr={master_addr}",
        f"--master_port={port}",
        f"--stop_grace_s={cfg.stop_grace_s:g}",
        *([f"--hang_timeout_s={cfg.hang_timeout_s:g}"] if cfg.hang_timeout_s else []),
        # Over ssh a stop comes on the agent's stdin; mpirun and srun pass on signals instead.
        *(["--control"] if node is not None else []),
        *(["--tee"] if remote else []),
        "--",
        *script_args,
    ]


def _env_port(environ: Mapping[str, str]) -> Optional[int]:
    value = environ.get("MASTER_PORT", "").strip()
    if value and not value.isdigit():
        raise LaunchError(f"MASTER_PORT={value!r} in the environment is not a port number")
    return int(value) if value else None


def _plain_master_addr(addr: str) -> str:
    if not _PLAIN.match(addr):
        raise HostfileError(f"master_addr={addr!r} is not a plain host name or IP address")
    return addr


def _count(hosts: dict[str, list[int]]) -> int:
    return sum(len(slots) for slots in hosts.values())


def _runs_on_cpu(environ: Mapping[str, str]) -> bool:
    accelerator = environ.get("DS_ACCELERATOR")
    if accelerator:
        return accelerator == "cpu"
    return _local_gpu_count(environ) == 0


def _local_gpu_count(environ: Mapping[str, str]) -> int:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    # The driver lists one directory per GPU; reading it keeps planning free of a torch import.
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        return len(list(gpus.iterdir()))
    # Containers may hide /proc/driver but still expose the device nodes.
    return len([p for p in Path("/dev").glob("nvidia[0-9]*") if p.name[6:].isdigit()])


def _local_resources(
    cfg: LauncherConfig, cpu: bool, environ: Mapping[str, str]
) -> dict[str, list[int]]:
    if cfg.num_nodes > 1:
        raise HostfileError(
            f"num_nodes={cfg.num_nodes} but no launcher.hostfile is set; "
            "list the nodes in a hostfile or set num_nodes to 1"
        )
    if cpu:
        if cfg.include or cfg.exclude:
            raise HostfileError(
                "include/exclude need a hostfile on a CPU-only launch; "
                "set launcher.num_gpus to the number of CPU ranks instead"
            )
        return {"localhost": list(range(cfg.num_gpus or 1))}
    count = cfg.num_gpus or _local_gpu_count(environ)
    if cfg.num_gpus is None and count == 0:
        raise HostfileError(
            "no GPU found on this machine and launcher.num_gpus is unset; set num_gpus to plan "
            "a GPU layout, or run on CPU (DS_ACCELERATOR=cpu)"
        )
    pool = {"localhost": count}
    return select_resources(pool, cfg.include, cfg.exclude, source="this machine")


def neox_pythonpath(existing: str) -> str:
    """PYTHONPATH for a child that must import this neox: its checkout first, then `existing`
    (where an environment may keep the packages neox needs), without repeats."""
    # neox's own checkout, so that the agent and the ranks import the neox that planned them.
    # Never the working directory (DeepSpeed's runner adds it): a sitecustomize.py there would
    # run in every process; the entry script's own folder is Python's sys.path[0] anyway.
    parts = [NEOX_ROOT] + [p for p in existing.split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def _export_names(cfg: LauncherConfig, env: Mapping[str, str]) -> list[str]:
    missing = [name for name in cfg.export_env if name not in env]
    if missing:
        raise LaunchError(
            f"launcher.export_env names {', '.join(missing)}, not set in this environment; "
            "set it in the shell that runs deepy.py, or remove it from export_env"
        )
    names = [k for k in env if k.startswith(EXPORT_PREFIXES) and k != "DS_ENV_FILE"]
    restart = [RESTART_ENV] if RESTART_ENV in env else []  # a relaunch's count, for its ranks
    return list(dict.fromkeys([*sorted(names), LAUNCH_ID_ENV, *restart, *cfg.export_env]))


def _slurm_args(cfg: LauncherConfig) -> list[str]:
    given = {"comment": cfg.comment, "account": cfg.account}
    if cfg.launcher != "slurm":
        wrong = [k for k, v in given.items() if v]
        if wrong:
            raise LaunchError(
                f"launcher.{wrong[0]} is set but launcher={cfg.launcher!r}; it is passed to "
                "srun only, so set launcher: slurm or remove it"
            )
        return []
    return [arg for k, v in given.items() if v for arg in (f"--{k}", v)]


def _check_backend_filters(cfg: LauncherConfig) -> None:
    # As gpt-neox (DeepSpeed's runner) does: its MPI backends take the whole hostfile, so a config
    # means the same on both.
    if cfg.launcher in ("openmpi", "mvapich"):
        used = [
            k
            for k, on in (
                ("include", bool(cfg.include)),
                ("exclude", bool(cfg.exclude)),
                ("num_nodes", cfg.num_nodes != -1),
                ("num_gpus", cfg.num_gpus is not None),
            )
            if on
        ]
        if used:
            raise HostfileError(
                f"launcher={cfg.launcher} runs every slot of the hostfile and cannot honour "
                f"{', '.join(used)}; edit the hostfile instead, or use launcher: pdsh"
            )


def _user_env_file_exports(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """NAME=value lines of the .deepspeed_env files (home, then cwd), exported to every node as
    DeepSpeed's runner does."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    lines: dict[str, str] = {}
    for folder in (os.path.expanduser("~"), cwd):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            if "=" not in line:
                raise LaunchError(f"{path}:{number}: expected NAME=value, got {line!r}")
            key, value = (part.strip() for part in line.split("=", 1))
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise LaunchError(f"{path}:{number}: {key!r} is not an environment variable name")
            lines[key] = value
    return lines
