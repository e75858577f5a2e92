"""deepy.py through DeepSpeed's openmpi and slurm launchers, for real, on this one machine: mpirun
starts CPU ranks on localhost; slurm runs munged, slurmctld and slurmd started here."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launcher.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def launch(tmp_path: Path, host: str, launcher: str, env: dict) -> dict[int, dict]:
    """Run tests/deepy_probe.py on 2 ranks of `host` through `launcher`; each rank's report."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{host} slots=2\n")
    flat = {
        "hostfile": str(hostfile),
        "launcher": launcher,
        "force_multi": True,  # one node, still through mpirun/srun
        "no_ssh_check": True,  # neither mpirun on localhost nor srun uses ssh
        "master_port": free_port(),
        "tokenizer_type": "CharLevelTokenizer",
        "hidden_size": 48,
        "seed": 77,
        "log_dir": str(tmp_path),
    }
    cfg = tmp_path / f"{launcher}.yml"
    cfg.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in flat.items()))
    r = subprocess.run(
        [sys.executable, "deepy.py", "tests/deepy_probe.py", str(cfg)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")]
    return {report["rank"]: report for report in reports}


def check_ranks(ranks: dict[int, dict]) -> None:
    assert sorted(ranks) == [0, 1]
    for report in ranks.values():
        assert report["world_size"] == 2 and report["sum"] == 3.0  # a real all-reduce
        # The merged config reached every rank.
        assert report["hidden_size"] == 48 and report["seed"] == 77
        assert report["ds_accelerator"] == "cpu"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (Debian openmpi-bin)")
def test_deepy_launches_through_openmpi(tmp_path):
    # Open MPI refuses to run as root unless told twice; CI containers run as root.
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    check_ranks(launch(tmp_path, "localhost", "openmpi", env))


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


def test_deepy_launches_through_slurm(slurm, tmp_path):
    check_ranks(launch(tmp_path, socket.gethostname(), "slurm", slurm))
