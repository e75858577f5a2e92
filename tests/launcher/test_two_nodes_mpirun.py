"""Two "nodes" on one host through mpirun (`launcher: openmpi`), the multi-node path that runs
on an image without sshd: two names of this machine in /etc/hosts on loopback aliases
(127.0.0.2, 127.0.0.3), a hostfile of those names with 2 slots each, or 1 on a 2-GPU host
(launcher: openmpi refuses `include`), and Open MPI's remote-launch agent (`plm_rsh_agent`)
replaced by a script that starts the "remote" daemon here, giving each name its share of the
GPUs through CUDA_VISIBLE_DEVICES. mpirun then starts one orted and one neox agent per name
(checked with Open MPI 4.1.4); the losses must equal the one-node run's."""

import os
import shutil
from pathlib import Path

import pytest

from tests.port_helpers import free_port
from tests.train_helpers import (
    SHORT_RUN,
    TWO_GPUS,
    losses,
    make_dataset,
    run_deepy,
    train,
    write_config,
)

pytestmark = pytest.mark.slow

NODES = {"neox-node-a": "127.0.0.2", "neox-node-b": "127.0.0.3"}
HOSTS = Path("/etc/hosts")


@pytest.fixture
def node_names():
    """Add the two names to /etc/hosts if missing; restore the file afterwards."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun (Open MPI) on PATH")
    if os.geteuid() != 0:
        pytest.skip("needs root to add neox-node-a/b (127.0.0.2/3) to /etc/hosts")
    before = HOSTS.read_text()
    missing = [f"{ip} {name}\n" for name, ip in NODES.items() if name not in before.split()]
    if missing:
        HOSTS.write_text(before + ("" if before.endswith("\n") else "\n") + "".join(missing))
    yield
    if missing:
        HOSTS.write_text(before)


def rsh_agent(tmp_path: Path, gpus: tuple[str, str]) -> Path:
    """plm_rsh_agent stand-in: log the host, drop it, run the orted command on this machine with
    that node's GPUs (the agent keeps a CUDA_VISIBLE_DEVICES it was started with) and a session
    directory of its own, as separate machines have: two daemons of one host name sharing
    /tmp/ompi.<host>.<uid> race creating it ("mkdir ... File exists", 1 launch in 40 here)."""
    for name in NODES:
        (tmp_path / name).mkdir()
    agent = tmp_path / "rsh_agent.sh"
    agent.write_text(
        f'#!/bin/sh\necho "$1" >> {tmp_path}/rsh.log\n'
        f'case "$1" in neox-node-a) export CUDA_VISIBLE_DEVICES={gpus[0]};; '
        f"*) export CUDA_VISIBLE_DEVICES={gpus[1]};; esac\n"
        f'export OMPI_MCA_orte_tmpdir_base="{tmp_path}/$1"\n'
        'shift\nexec sh -c "$*"\n'
    )
    agent.chmod(0o755)
    return agent


# (ranks a node, TP size, each node's GPUs): two CPU ranks a node (CI); on a 4-GPU host 2 GPUs a
# node at TP2 x DP2 (issue 34's layout); on a 2-GPU host one GPU a node, DP=2 across the "nodes".
LAYOUTS = {
    "cpu_ranks": (2, 2, ("0,1", "2,3")),
    "gpus": (2, 2, ("0,1", "2,3")),
    "gpus_one_each": (1, 1, ("0", "1")),
}


@pytest.mark.parametrize(
    "layout",
    [
        "cpu_ranks",
        pytest.param("gpus", marks=pytest.mark.multigpu),
        pytest.param("gpus_one_each", marks=[pytest.mark.gpu, TWO_GPUS]),
    ],
)
def test_two_nodes_mpirun_match_one_node(node_names, layout, tmp_path):
    slots, tp, gpus = LAYOUTS[layout]
    cpu = layout == "cpu_ranks"
    # fp32, the same reduction layout on one node and two: the losses agree to rounding.
    run = dict(
        SHORT_RUN,
        model_parallel_size=tp,
        distributed_backend="gloo" if cpu else "nccl",
        zero_optimization={},
        gradient_accumulation_steps=1,
    )
    make_dataset(tmp_path / "data" / "chars")
    one = write_config(tmp_path, "one", num_gpus=2 * slots, **run)
    if cpu:  # its CPU ranks started from this process (deepy.py on one node: tests/test_demo.py)
        train(one)
    else:
        run_deepy("train.py", one, cpu=False)

    a, b = NODES
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{a} slots={slots}\n{b} slots={slots}\n")
    two = write_config(
        tmp_path,
        "two",
        num_gpus=None,
        hostfile=str(hostfile),
        launcher="openmpi",
        master_port=free_port(),
        no_ssh_check=True,
        **run,
    )
    out = run_deepy(
        "train.py",
        two,
        cpu=cpu,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_plm_rsh_agent=str(rsh_agent(tmp_path, gpus)),
        OMPI_MCA_oob_tcp_if_include="lo",
        OMPI_MCA_btl_tcp_if_include="lo",
    ).stdout
    started = (tmp_path / "rsh.log").read_text().split() if (tmp_path / "rsh.log").exists() else []
    assert sorted(started) == [a, b], (
        f"mpirun must start one daemon per name through plm_rsh_agent; it started {started}"
    )
    one, both = losses(tmp_path / "one" / "logs"), losses(tmp_path / "two" / "logs")
    assert sorted(both) == [1, 2, 3, 4, 5], out[-3000:]
    for step, loss in one.items():
        assert both[step] == pytest.approx(loss, rel=1e-4), (step, one, both)
