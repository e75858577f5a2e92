"""Real launches through the neox agent: local CPU ranks, two nodes over ssh/sshd, rank death."""

import base64
import json
import os
import threading
import time
from pathlib import Path

import pytest

from neox.config.launcher import LauncherConfig
from neox.launcher import build_launch, launch
from tests.port_helpers import free_port
from tests.process_helpers import wait_until_none
from tests.training.lifecycle_helpers import pids_with_env

PROBE = str(Path(__file__).with_name("probe_helpers.py"))
TRICKY = "a \"b\" $(echo injected) 'c' `id` \\ end"

pytestmark = pytest.mark.slow


def launch_pids(launch_id: str) -> list[int]:
    """Live processes (not zombies) whose environment carries this launch's NEOX_LAUNCH_ID."""
    return pids_with_env("NEOX_LAUNCH_ID", launch_id)


def results(out: Path) -> dict[int, dict]:
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank*.json"))}


def test_two_local_cpu_ranks_all_reduce_and_get_the_config(tmp_path):
    config = {"hidden_size": 32, "note": "spaces and $(echo x)"}
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    cfg = LauncherConfig(num_gpus=2, master_port=free_port())
    args = ["--out", str(tmp_path), "--neox_config", encoded, "--echo", TRICKY]
    plan = build_launch(cfg, PROBE, args, cpu=True)
    assert launch(plan).code == 0
    ranks = results(tmp_path)
    assert set(ranks) == {0, 1}
    for rank, r in ranks.items():
        assert (r["world_size"], r["comm_world_size"], r["comm_rank"]) == (2, 2, rank)
        assert r["local_rank"] == r["arg_local_rank"] == rank
        assert r["all_reduce"] == 0 + 1
        assert r["config"] == config and r["echo"] == TRICKY
        assert r["ds_accelerator"] == "cpu"


def test_local_rank_death_ends_the_launch_naming_the_rank_and_its_traceback(tmp_path, caplog):
    cfg = LauncherConfig(num_gpus=2, master_port=free_port())
    plan = build_launch(cfg, PROBE, ["--out", str(tmp_path), "--die_rank", "1"], cpu=True)
    start = time.monotonic()
    with caplog.at_level("ERROR", logger="neox.launcher.run"):
        code = launch(plan).code
    assert code == 1 and time.monotonic() - start < 20
    assert launch_pids(plan.launch_id) == []  # the sleeping rank 0 is gone too
    [message] = caplog.messages
    assert message.startswith("rank 1 on ") and "exited with status 1" in message, message
    assert "RuntimeError: probe rank 1 fails on purpose" in message  # the tail of its stderr


def test_kill_9_of_the_agent_ends_the_launch_naming_it(tmp_path, caplog):
    cfg = LauncherConfig(num_gpus=2, master_port=free_port())
    plan = build_launch(cfg, PROBE, ["--out", str(tmp_path), "--die_rank", "7"], cpu=True)

    def kill_the_agent() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for pid in launch_pids(plan.launch_id):
                if b"neox.launcher.agent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    if len(launch_pids(plan.launch_id)) == 3:  # the agent and its two ranks
                        os.kill(pid, 9)
                        return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_the_agent)
    killer.start()
    with caplog.at_level("ERROR", logger="neox.launcher.run"):
        code = launch(plan).code
    killer.join()
    assert code == 128 + 9
    assert "the agent on localhost ended with status 137 and no report" in caplog.text
    assert wait_until_none(lambda: launch_pids(plan.launch_id)) == []  # its ranks died with it


@pytest.fixture
def two_nodes(sshd, tmp_path, monkeypatch):
    """A hostfile of two names for this machine, both reached over ssh through the private sshd."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=2\n")
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", sshd.ssh_args)
    monkeypatch.setenv("NEOX_TEST_EXPORT", TRICKY)
    return LauncherConfig(
        hostfile=str(hostfile),
        launcher="pdsh",
        master_addr="127.0.0.1",
        master_port=free_port(),
        ssh_port=sshd.port,
        no_ssh_check=True,
        export_env=["NEOX_TEST_EXPORT"],
    )


def test_two_nodes_over_pdsh_all_reduce(two_nodes, tmp_path, monkeypatch):
    # The ranks' only way to learn DS_ACCELERATOR is the environment exported to the nodes.
    monkeypatch.delenv("DS_ACCELERATOR")
    out = tmp_path / "out"
    plan = build_launch(two_nodes, PROBE, ["--out", str(out), "--echo", TRICKY], cpu=True)
    assert plan.launcher == "pdsh" and plan.world_size == 3
    assert launch(plan).code == 0
    ranks = results(out)
    assert set(ranks) == {0, 1, 2}
    assert [ranks[r]["node_rank"] for r in (0, 1, 2)] == [0, 1, 1]
    assert {ranks[1]["local_rank"], ranks[2]["local_rank"]} == {0, 1}
    for r in ranks.values():
        assert (r["world_size"], r["comm_world_size"], r["all_reduce"]) == (3, 3, 0 + 1 + 2)
        assert r["ds_accelerator"] == "cpu"
        assert r["export_probe"] == TRICKY and r["echo"] == TRICKY


def test_rank_death_on_one_node_stops_the_other_node(two_nodes, tmp_path):
    # Rank 2 (node 1) fails; rank 0 (node 0) sleeps and would hold pdsh open for ever.
    plan = build_launch(two_nodes, PROBE, ["--out", str(tmp_path), "--die_rank", "2"], cpu=True)
    start = time.monotonic()
    code = launch(plan).code
    assert code == 1 and time.monotonic() - start < 20
    assert launch_pids(plan.launch_id) == []


def test_kill_9_of_a_nodes_ssh_session_ends_the_launch_on_every_node(two_nodes, tmp_path, caplog):
    plan = build_launch(two_nodes, PROBE, ["--out", str(tmp_path), "--die_rank", "7"], cpu=True)

    def kill_the_ssh_to_the_second_node() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if len(launch_pids(plan.launch_id)) == 2 + 2 + 3:  # ssh clients, agents, ranks
                for pid in launch_pids(plan.launch_id):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if argv[0] == b"ssh" and argv[-3] == b"127.0.0.1":
                        os.kill(pid, 9)
                        return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_the_ssh_to_the_second_node)
    killer.start()
    start = time.monotonic()
    with caplog.at_level("ERROR", logger="neox.launcher.run"):
        code = launch(plan).code
    killer.join()
    assert code == 128 + 9 and time.monotonic() - start < 120
    assert "ssh to 127.0.0.1 ended with status 137 and no report" in caplog.text
    # The second node's agent saw its session end and stopped its ranks; the first was told to.
    deadline = time.monotonic() + 20
    while launch_pids(plan.launch_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launch_pids(plan.launch_id) == []


def test_the_working_directory_is_not_put_on_the_ranks_python_path(tmp_path):
    """Issue 33 (defect 10): deepy put its working directory first on every rank's PYTHONPATH,
    so a sitecustomize.py there ran in the agent and every rank. Only neox's own checkout is
    added now (the entry script's folder is Python's own sys.path[0])."""
    work, job = tmp_path / "work", tmp_path / "job"
    work.mkdir()
    job.mkdir()
    marker = tmp_path / "sitecustomize_ran"
    (work / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'a').write('x')\n")
    (job / "entry.py").write_text("import neox.launcher\n")  # neox still imports on the ranks
    cfg = LauncherConfig(num_gpus=2, master_port=free_port())
    plan = build_launch(cfg, str(job / "entry.py"), [], cpu=True, cwd=str(work))
    assert str(work) not in plan.env["PYTHONPATH"].split(os.pathsep)
    assert launch(plan).code == 0
    assert not marker.exists()
