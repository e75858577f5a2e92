"""deepy.py through the openmpi and slurm launchers, for real, on this one machine: mpirun starts
the agent on localhost; slurm runs munged, slurmctld and slurmd started here, and srun starts it.
The agent starts the ranks as its children, so stops, deaths and kill -9 behave as over ssh."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.port_helpers import free_port
from tests.train_helpers import make_dataset, records, write_config
from tests.training.lifecycle_helpers import MARK, BackgroundRun

ROOT = Path(__file__).resolve().parents[2]
# One worker under pytest-xdist: the slurm cluster (a module fixture, reached through
# getfixturevalue, which tests/conftest.py's grouping cannot see) starts once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("mpi_slurm")]
# Open MPI refuses to run as root unless told twice; CI containers run as root.
OMPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# The agent's parent on this machine: mpirun itself (no orted on its own host), slurm's stepd.
AGENT_PARENT = {"openmpi": "mpirun", "slurm": "slurmstepd"}


SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


def slurm_conf(folder: Path, host: str) -> str:
    return "\n".join(
        [
            "ClusterName=neoxtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={folder / 'munge.sock'}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            # No cgroups: plain process tracking works in a container.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
            # Two ranks even on a one-core machine.
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
            "",
        ]
    )


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[dict[str, str]]:
    """munged, slurmctld and slurmd of a one-node cluster; yields the env that reaches it."""
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian slurm-wlm and munge)")
    if os.geteuid() != 0:
        pytest.skip("starting slurmd needs root")
    folder = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    key = folder / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    host = socket.gethostname()
    conf = folder / "slurm.conf"
    conf.write_text(slurm_conf(folder, host))
    env = {"SLURM_CONF": str(conf)}
    daemons = []
    try:
        subprocess.run(
            [
                "munged",
                "--force",
                f"--key-file={key}",
                f"--socket={folder / 'munge.sock'}",
                f"--pid-file={folder / 'munged.pid'}",
                f"--log-file={folder / 'munged.log'}",
                f"--seed-file={folder / 'munge.seed'}",
            ],
            check=True,
            timeout=30,
        )
        for daemon in ("slurmctld", "slurmd"):
            log = open(folder / f"{daemon}.out", "wb")  # noqa: SIM115 (held by the daemon)
            daemons.append(
                subprocess.Popen([daemon, "-D", "-f", str(conf)], stdout=log, stderr=log)
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=dict(os.environ, **env), capture_output=True
            )
            if state.stdout.strip() == b"idle":
                break
            time.sleep(1)
        else:
            logs = [(folder / f"{d}.log").read_text()[-800:] for d in ("slurmctld", "slurmd")]
            pytest.skip(f"slurm did not come up within 60 s: {' | '.join(logs)}")
        yield env
    finally:
        for proc in daemons:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        pid_file = folder / "munged.pid"
        if pid_file.is_file():
            os.kill(int(pid_file.read_text()), 15)


@pytest.fixture(params=["openmpi", "slurm"])
def launcher(request) -> tuple[str, str, dict[str, str]]:
    """(launcher, this machine's name in the hostfile, environment) for mpirun, then srun."""
    if request.param == "openmpi":
        if shutil.which("mpirun") is None:
            pytest.skip("needs mpirun (Debian openmpi-bin)")
        return "openmpi", "localhost", OMPI_AS_ROOT
    return "slurm", socket.gethostname(), request.getfixturevalue("slurm")


def one_node(tmp_path: Path, launcher: str, host: str) -> dict:
    """Config keys of a 2-rank launch of this machine through `launcher`."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{host} slots=2\n")
    return dict(
        hostfile=str(hostfile),
        launcher=launcher,
        force_multi=True,  # one node, still through mpirun/srun
        no_ssh_check=True,
        num_gpus=None,  # mpirun takes every slot of the hostfile
        export_env=[MARK],  # named to mpirun -x / srun --export
    )


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def training(tmp_path: Path, launcher: str, host: str, env: dict, **extra) -> BackgroundRun:
    """deepy.py train.py, a tiny run of 1000 steps on 2 ranks, once its step 2 is logged; extra
    config keys."""
    make_dataset(tmp_path / "data" / "chars")
    keys = dict(checkpoint_factor=None, eval_interval=1000, do_test=False, **extra)
    node = one_node(tmp_path, launcher, host)
    run = BackgroundRun(write_config(tmp_path, launcher, train_iters=1000, **keys, **node),
                        tmp_path / "run.out", **env)  # fmt: skip
    run.wait_for("iter 2/1000")
    return run


def test_ranks_are_the_agents_children_and_sigterm_saves(launcher, tmp_path):
    """deepy.py through mpirun/srun: the 2 ranks train (the config and collectives reach them),
    each the child of an agent that mpirun/srun started, with the rank variables set."""
    name, host, env = launcher
    # Under max_restarts, with the agents watching heartbeats: a stop is never restarted.
    run = training(tmp_path, name, host, env, max_restarts=1, hang_timeout_s=600)
    try:
        for rank in (0, 1):
            pid = run.rank_pid(rank)
            agent = parent(pid)
            assert b"neox.launcher.agent" in Path(f"/proc/{agent}/cmdline").read_bytes()
            assert Path(f"/proc/{parent(agent)}/comm").read_text().strip() == AGENT_PARENT[name]
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            for var in (f"RANK={rank}", f"LOCAL_RANK={rank}", "WORLD_SIZE=2", "DS_ACCELERATOR=cpu"):
                assert var.encode() in environ, (var, environ)
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.wait() == 0, run.text()[-3000:]
        assert run.pids() == []
    finally:
        run.kill_all()
    out = run.text()
    # mpirun/srun passed the stop on to the agent (SIGUSR1), which passed SIGTERM to its ranks.
    assert "stop requested by deepy.py: SIGTERM to 2 rank(s)" in out, out[-3000:]
    assert out.count("launching 2 rank(s)") == 1 and "restart 1/1" not in out, out[-3000:]
    ckpt = tmp_path / name / "ckpt"
    tag = (ckpt / "latest").read_text()
    assert f"deepy: stopped by SIGTERM; checkpoint saved in {ckpt / tag}" in out.splitlines()
    assert [p.name for p in ckpt.glob("global_step*")] == [tag]
    assert "Traceback" not in out


def test_kill_9_of_deepy_saves_the_last_step_and_leaves_nothing(launcher, tmp_path):
    name, host, env = launcher
    run = training(tmp_path, name, host, env)
    try:
        # mpirun/srun get SIGUSR1 from the kernel (PR_SET_PDEATHSIG; once per thread of deepy.py)
        # and pass it on: the agent stops its ranks as on SIGTERM, they save, all exit.
        run.kill_9_deepy()
    finally:
        run.kill_all()
    steps = [r["step"] for r in records(tmp_path / name / "logs") if r["split"] == "train"]
    assert (tmp_path / name / "ckpt" / "latest").read_text() == f"global_step{steps[-1]}"


def sleeping_ranks(tmp_path: Path, launcher: str, host: str, env: dict) -> BackgroundRun:
    """deepy.py starting 2 ranks of tests/deepy_probe_helpers.py that sleep (no rank is `exit_interval`)."""
    flat = dict(one_node(tmp_path, launcher, host), exit_interval=7, master_port=free_port())
    flat.update(tokenizer_type="CharLevelTokenizer", log_dir=str(tmp_path))
    cfg = tmp_path / "probe.yml"
    cfg.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in flat.items()))
    return BackgroundRun(cfg, tmp_path / "run.out", "tests/deepy_probe_helpers.py", **env)


def rank_pids(run: BackgroundRun) -> list[int]:
    deadline = time.monotonic() + 120
    while True:
        try:
            return [run.rank_pid(0), run.rank_pid(1)]
        except (AssertionError, OSError):  # not started yet; a short-lived process just ended
            assert run.proc.poll() is None and time.monotonic() < deadline, run.text()[-3000:]
            time.sleep(0.2)


def test_a_rank_killed_ends_the_job_naming_it(launcher, tmp_path):
    name, host, env = launcher
    run = sleeping_ranks(tmp_path, name, host, env)
    try:
        rank1 = rank_pids(run)[1]
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        assert run.wait() == 128 + signal.SIGKILL, run.text()[-3000:]
        assert time.monotonic() - killed < 30
        assert run.pids() == []
    finally:
        run.kill_all()
    assert f"rank 1 on {socket.gethostname()} (pid {rank1}) was killed by SIGKILL" in run.text()


def test_sigterm_while_the_agent_starts_still_reaches_the_ranks(launcher, tmp_path):
    name, host, env = launcher
    run = sleeping_ranks(tmp_path, name, host, env)
    try:
        run.wait_for("launching 2 rank(s)")  # the agent does not exist yet
        os.kill(run.proc.pid, signal.SIGTERM)
        start = time.monotonic()
        run.wait()
        assert time.monotonic() - start < 60 and run.pids() == []
    finally:
        run.kill_all()
    # The stop waited for the agent's ready line: it did not kill the agent before its ranks.
    assert "stop requested by deepy.py: SIGTERM to 2 rank(s)" in run.text(), run.text()[-3000:]


def test_kill_9_of_a_rank_restarts_every_agent_from_the_checkpoint(launcher, tmp_path):
    """max_restarts through mpirun/srun: rank 1 killed between two checkpoints, the job relaunched
    (tests/faults/test_restart_faults.py: exit 0, the losses of an uninterrupted run)."""
    from tests.faults.test_restart_faults import restart_between_checkpoints

    name, host, env = launcher
    # One thread per rank, as the reference's ranks have: the same sums.
    node = dict(one_node(tmp_path, name, host), export_env=["OMP_NUM_THREADS"])
    out = restart_between_checkpoints(tmp_path, node, OMP_NUM_THREADS="1", **env)
    assert out.count("launching 2 rank(s)") == 2, out[-3000:]
