"""Plan a launch: the DeepSpeed runner command, its environment and what reaches the nodes."""

import logging
import os
import shlex
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from neox.config.launcher import LauncherConfig
from neox.launcher.hostfile import HostfileError, LaunchError, read_hostfile, select_resources
from neox.launcher.lifeline import LAUNCHER_ENV, launcher_identity
from neox.launcher.port import DEFAULT_MASTER_PORT, free_port
from neox.launcher.quoting import encode_export, is_shell_plain, quote_pdsh_arg, quote_pdsh_script

log = logging.getLogger(__name__)

# DeepSpeed's runner reads /job/hostfile when given none (its DLTS default); we honour the same file.
DEFAULT_HOSTFILE = "/job/hostfile"
# Variables the runner exports to nodes by prefix (runner.EXPORT_ENVS plus the CUDA accelerator's
# NCCL), and our DS_ for DS_ACCELERATOR and friends.
EXPORT_PREFIXES = ("PYTHON", "MLFLOW", "MV2", "UCX", "NCCL", "DS_")
# Tags every process of one launch (inherited through the environment), so a watchdog can end
# exactly those on every node without matching other jobs by name.
LAUNCH_ID_ENV = "NEOX_LAUNCH_ID"
NEOX_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class LaunchPlan:
    """Everything run_launch needs, and what --dry-run shows: argv, environment, layout."""

    argv: list[str]
    """The DeepSpeed runner command line."""
    env: dict[str, str]
    """Full environment of the runner process."""
    exports: dict[str, str]
    """Variables set on every node (written to the runner's .deepspeed_env for multi-node)."""
    hosts: dict[str, list[int]]
    """Active hosts and their slot ids, in rank order."""
    world_size: int
    """Total number of ranks."""
    launcher: str
    """'local' (one node, DeepSpeed's launch.py) or the multi-node backend: pdsh, openmpi..."""
    cwd: str
    """Working directory of the runner, and of the ranks on every node."""
    launch_id: str
    """Unique tag of this launch, set as NEOX_LAUNCH_ID in every rank's environment."""
    env_file_text: str = ""
    """Contents of the .deepspeed_env handed to the runner (multi-node only)."""
    ssh_port: Optional[int] = None
    """sshd port of the nodes, for pdsh."""
    cpu: bool = False
    """Ranks run on CPU (DS_ACCELERATOR=cpu, gloo)."""
    command: str = field(init=False)
    """The runner command as one shell-safe line, for --dry-run."""

    def __post_init__(self) -> None:
        self.command = shlex.join(self.argv)

    @property
    def multi_node(self) -> bool:
        """True when the ranks are started through a multi-node backend (pdsh, mpirun, srun)."""
        return self.launcher != "local"


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
    hostfile = cfg.hostfile
    if hostfile is not None and not os.path.isfile(hostfile):
        # gpt-neox's stock configs carry `hostfile: /mock_path`; DeepSpeed's runner reads a
        # missing hostfile as "run on this machine only", and so do we, loudly.
        log.warning(
            "WARNING: hostfile %s does not exist: running on this machine only (as DeepSpeed's "
            "runner does); remove `hostfile` or point it at a real file to use other nodes",
            hostfile,
        )
        hostfile = None
    elif hostfile is None and os.path.isfile(DEFAULT_HOSTFILE):
        log.info("no launcher.hostfile set; using %s as DeepSpeed's runner would", DEFAULT_HOSTFILE)
        hostfile = DEFAULT_HOSTFILE
    launch_id = uuid.uuid4().hex
    runner = [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    env = dict(environ)
    env[LAUNCH_ID_ENV] = launch_id
    env[LAUNCHER_ENV] = launcher_identity()  # so ranks end when this process is killed
    env["PYTHONPATH"] = _pythonpath(cwd, environ.get("PYTHONPATH", ""))
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    env.pop("DS_ENV_FILE", None)  # run_launch points it at the file this plan writes

    if hostfile is None:
        hosts = _local_resources(cfg, cpu, environ)
        argv = runner + [f"--master_port={cfg.master_port or free_port()}"]
        if cfg.master_addr:
            # DeepSpeed's runner pins a one-node launch to 127.0.0.1 whatever it is told.
            log.warning(
                "WARNING: master_addr=%s is not used: without a hostfile every rank runs on this "
                "machine and meets at 127.0.0.1; give a hostfile to place rank 0 elsewhere",
                _plain_master_addr(cfg.master_addr),
            )
        if cfg.include or cfg.exclude:
            argv.append(f"--include={cfg.include}" if cfg.include else f"--exclude={cfg.exclude}")
        elif cpu or cfg.num_gpus is not None:
            argv.append(f"--num_gpus={len(hosts['localhost'])}")
        argv += [script, *script_args]
        exports = {k: env[k] for k in _export_names(cfg, env)}
        return LaunchPlan(
            argv, env, exports, hosts, _count(hosts), "local", cwd, launch_id, cpu=cpu
        )

    pool = read_hostfile(hostfile)
    num_nodes = cfg.num_nodes
    hosts = select_resources(pool, cfg.include, cfg.exclude, num_nodes, cfg.num_gpus, hostfile)
    multi = cfg.force_multi or len(hosts) > 1
    launcher = cfg.launcher if multi else "local"
    argv = runner + [f"--hostfile={hostfile}"]
    if cfg.include:
        argv.append(f"--include={cfg.include}")
    if cfg.exclude:
        argv.append(f"--exclude={cfg.exclude}")
    if num_nodes != -1:
        argv.append(f"--num_nodes={num_nodes}")
    if cfg.num_gpus is not None:
        argv.append(f"--num_gpus={cfg.num_gpus}")
    argv.append(f"--launcher={cfg.launcher}")
    master_addr = cfg.master_addr
    if master_addr is None and cfg.launcher != "pdsh":
        # DeepSpeed's runner would ssh to the first host for `hostname -I`; mpirun and srun
        # need no ssh, so the first host's name serves as the rendezvous address.
        master_addr = next(iter(hosts))
    if master_addr:
        argv.append(f"--master_addr={_plain_master_addr(master_addr)}")
    port = cfg.master_port or (DEFAULT_MASTER_PORT if multi else free_port())
    argv.append(f"--master_port={port}")
    if cfg.ssh_port is not None:
        argv.append(f"--ssh_port={cfg.ssh_port}")
    if cfg.no_ssh_check:
        argv.append("--no_ssh_check")
    if cfg.force_multi:
        argv.append("--force_multi")
    slurm_args = _slurm_args(cfg)
    if slurm_args:
        argv.append(f"--launcher_args={shlex.join(slurm_args)}")
    _check_backend_filters(cfg)

    exports = {k: env[k] for k in _export_names(cfg, env)}
    if launcher in ("openmpi", "mvapich", "slurm"):
        # mpirun and srun start the ranks directly: DeepSpeed tells them no rendezvous address.
        exports["MASTER_ADDR"] = master_addr
        exports["MASTER_PORT"] = str(cfg.master_port)
    env_file_text = ""
    if launcher == "pdsh":
        _check_pdsh_paths(cwd)
        argv += [quote_pdsh_script(script), *(quote_pdsh_arg(a) for a in script_args)]
    else:
        argv += [script, *script_args]
    if multi:
        user_lines = _user_env_file_lines(environ, cwd)
        ours = [
            encode_export(k, v) if launcher == "pdsh" else f"{k}={v}" for k, v in exports.items()
        ]
        env_file_text = "".join(line + "\n" for line in user_lines + ours)
    return LaunchPlan(
        argv,
        env,
        exports,
        hosts,
        _count(hosts),
        launcher,
        cwd,
        launch_id,
        env_file_text=env_file_text,
        ssh_port=cfg.ssh_port,
        cpu=cpu,
    )


def _plain_master_addr(addr: str) -> str:
    if not is_shell_plain(addr):
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


def _pythonpath(cwd: str, existing: str) -> str:
    parts = [cwd, NEOX_ROOT] + [p for p in existing.split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def _export_names(cfg: LauncherConfig, env: Mapping[str, str]) -> list[str]:
    missing = [name for name in cfg.export_env if name not in env]
    if missing:
        raise LaunchError(
            f"launcher.export_env names {', '.join(missing)}, not set in this environment; "
            "set it in the shell that runs deepy.py, or remove it from export_env"
        )
    names = [k for k in env if k.startswith(EXPORT_PREFIXES) and k != "DS_ENV_FILE"]
    return list(dict.fromkeys([*sorted(names), LAUNCH_ID_ENV, LAUNCHER_ENV, *cfg.export_env]))


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
    # DeepSpeed's MPI backends take the whole hostfile; fail before launch, not inside the runner.
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


def _check_pdsh_paths(cwd: str) -> None:
    # DeepSpeed writes `cd <cwd>; <python> -u -m ...` unquoted into the remote command.
    for what, path in (("working directory", cwd), ("python executable", sys.executable)):
        if not is_shell_plain(path):
            raise LaunchError(
                f"the {what} {path!r} has spaces or shell characters, which DeepSpeed's pdsh "
                "runner places unquoted in the remote command; launch from a plain path"
            )


def _user_env_file_lines(environ: Mapping[str, str], cwd: str) -> list[str]:
    """Lines of the .deepspeed_env files DeepSpeed would read (home, then cwd), kept as written."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    lines: list[str] = []
    for folder in (os.path.expanduser("~"), cwd):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            if "=" not in line:
                raise LaunchError(f"{path}:{number}: expected NAME=value, got {line!r}")
            lines.append(line)
    return lines
