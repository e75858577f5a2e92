"""The per-node agent: the ranks' parent. It names the first rank to fail by construction, stops
its ranks when its own parent dies (kill -9), and leaves neither a process nor a /dev/shm buffer."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from neox.launcher.process import REPORT_PREFIX
from tests.port_helpers import free_port
from tests.process_helpers import alive, child_env

ROOT = Path(__file__).resolve().parents[2]

# A rank stand-in. "stuck": notes SIGTERM and stays (as one blocked in a collective would), after
# creating a DeepSpeed-like shm buffer; "race": rank 1 is SIGKILLed, rank 0 fails on it once
# the agent has reaped rank 1 (its /proc entry gone), never a guessed time later.
RANK = """
import os, signal, sys, time
from pathlib import Path
rank, mode, out = int(os.environ["RANK"]), sys.argv[-2], Path(sys.argv[-1])
def note(name, text):  # whole or absent: the test reads a file as soon as it exists
    (out / f"{name}.tmp").write_text(text)
    (out / f"{name}.tmp").rename(out / name)
if mode == "stuck":
    port = os.environ["MASTER_PORT"]
    Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}").write_text("x")
    signal.signal(signal.SIGTERM, lambda *_: (out / f"term{rank}").write_text(str(os.getpid())))
    note(f"pid{rank}", str(os.getpid()))
    time.sleep(120)
if rank == 1:
    note("pid1", str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)
while not (out / "pid1").exists() or Path(f"/proc/{(out / 'pid1').read_text()}").exists():
    time.sleep(0.01)
print("rank 0 sees its peer gone", file=sys.stderr)
sys.exit(1)
"""

# deepy.py's part: start the agent as its child with the parent-death signal, keep its stdin.
PARENT = """
import subprocess, sys
from neox.launcher.process import child_dies_with_me
import signal
agent = subprocess.Popen(sys.argv[1:], stdin=subprocess.PIPE,
                         preexec_fn=child_dies_with_me(signal.SIGHUP))
print(agent.pid, flush=True)
agent.wait()
"""


def agent_argv(
    tmp_path: Path, mode: str, port: int, grace_s: float = 1.0, control: bool = True
) -> list[str]:
    """The agent's command line for two ranks of RANK (the control channel: its stdin)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return [
        sys.executable,
        "-m",
        "neox.launcher.agent",
        "--node_rank=0",
        "--nodes=2",
        "--devices=0,1",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        f"--stop_grace_s={grace_s}",
        *(["--control"] if control else []),
        "--tee",
        str(script),
        mode,
        str(tmp_path),
    ]


def env() -> dict[str, str]:
    return child_env(DS_ACCELERATOR="cpu")


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_first_rank_to_fail_is_named_with_its_status_and_the_others_killed(tmp_path):
    r = subprocess.run(
        agent_argv(tmp_path, "race", free_port(), control=False),
        env=env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    [line] = [ln for ln in r.stdout.splitlines() if ln.startswith(REPORT_PREFIX)]
    report = json.loads(line[len(REPORT_PREFIX) :])
    # Rank 1's SIGKILL came first; rank 0's exit 1 after it is not taken for the cause.
    assert report["failure"]["rank"] == 1 and report["failure"]["status"] == signal.SIGKILL
    assert report["code"] == 128 + signal.SIGKILL == r.returncode


def test_a_failed_rank_is_named_with_the_end_of_its_stderr(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os\nif os.environ['RANK'] == '1': raise ValueError('bad shard')\n")
    argv = agent_argv(tmp_path, "", free_port(), control=False)[:-3] + [str(script)]
    r = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=60)
    report = json.loads(r.stdout.split(REPORT_PREFIX, 1)[1])
    assert report["failure"]["rank"] == 1 and report["code"] == 1 == r.returncode
    assert report["failure"]["tail"][-1] == "ValueError: bad shard"
    assert "ValueError: bad shard" in r.stderr  # relayed too


def test_kill_9_of_the_parent_stops_the_ranks_then_kills_them_and_cleans_up(tmp_path):
    port = free_port()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, *agent_argv(tmp_path, "stuck", port, grace_s=1.0)],
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        agent = int(parent.stdout.readline())
        wait_for(lambda: all((tmp_path / f"pid{r}").exists() for r in (0, 1)))
        ranks = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        assert alive(agent) and all(map(alive, ranks))
        parent.kill()
        start = time.monotonic()
        # The agent gets SIGHUP from the kernel and passes SIGTERM on; the ranks ignore it, and
        # are killed after stop_grace_s.
        wait_for(lambda: not alive(agent) and not any(map(alive, ranks)))
        assert time.monotonic() - start < 20
        assert all((tmp_path / f"term{r}").exists() for r in (0, 1))
        assert list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")) == []
    finally:
        parent.kill()
        parent.wait()


def test_kill_9_of_the_agent_takes_its_ranks_with_it(tmp_path):
    agent = subprocess.Popen(
        agent_argv(tmp_path, "stuck", free_port(), grace_s=600), env=env(), stdin=subprocess.PIPE
    )
    try:
        wait_for(lambda: all((tmp_path / f"pid{r}").exists() for r in (0, 1)))
        ranks = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        agent.kill()
        wait_for(lambda: not any(map(alive, ranks)))  # PR_SET_PDEATHSIG=SIGKILL on each rank
        assert not any((tmp_path / f"term{r}").exists() for r in (0, 1))
    finally:
        agent.kill()
        agent.wait()


def test_control_channel_stop_then_kill(tmp_path):
    agent = subprocess.Popen(
        agent_argv(tmp_path, "stuck", free_port(), grace_s=600),
        env=env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: all((tmp_path / f"pid{r}").exists() for r in (0, 1)))
        agent.stdin.write("stop\n")
        agent.stdin.flush()
        wait_for(lambda: all((tmp_path / f"term{r}").exists() for r in (0, 1)))
        assert agent.poll() is None  # the ranks are given stop_grace_s to save
        agent.stdin.write("kill\n")
        agent.stdin.flush()
        assert agent.wait(timeout=20) == 128 + signal.SIGKILL
        report = json.loads(agent.stdout.read().split(REPORT_PREFIX, 1)[1])
        assert report["failure"]["killed_by_agent"] == "deepy.py asked"
    finally:
        agent.kill()
        agent.wait()


# A rank stand-in that writes where it was placed, notes SIGTERM and stays.
PLACED = """
import json, os, signal, sys, time
from pathlib import Path
out, rank = Path(sys.argv[-1]), os.environ["RANK"]
signal.signal(signal.SIGTERM, lambda *_: (out / f"term{rank}").write_text("x"))
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK", "SLURM_PROCID", "CUDA_VISIBLE_DEVICES")
(out / f"env{rank}.tmp").write_text(json.dumps({k: os.environ.get(k) for k in keys}))
(out / f"env{rank}.tmp").rename(out / f"env{rank}")  # whole or absent: read once it exists
time.sleep(120)
"""


def test_under_srun_the_node_rank_comes_from_it_and_usr1_usr2_stop_and_kill(tmp_path):
    """srun's way: node rank in SLURM_NODEID, a GPU allocation in CUDA_VISIBLE_DEVICES, and
    SIGUSR1/SIGUSR2 delivered to every process of the job, ranks included."""
    script = tmp_path / "placed.py"
    script.write_text(PLACED)
    argv = [sys.executable, "-m", "neox.launcher.agent", "--node_rank_env=SLURM_NODEID"]
    argv += ["--nodes=1,2", "--devices=0/1,0", "--master_addr=127.0.0.1"]
    argv += [f"--master_port={free_port()}", "--stop_grace_s=600", str(script), str(tmp_path)]
    placed = dict(SLURM_NODEID="1", SLURM_PROCID="1", CUDA_VISIBLE_DEVICES="4,5")
    environ = {k: v for k, v in env().items() if k != "DS_ACCELERATOR"}
    agent = subprocess.Popen(
        argv, env=dict(environ, **placed), stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        wait_for(lambda: all((tmp_path / f"env{r}").exists() for r in (1, 2)))
        seen = {r: json.loads((tmp_path / f"env{r}").read_text()) for r in (1, 2)}
        assert seen[1] == dict(
            RANK="1", LOCAL_RANK="0", WORLD_SIZE="3", CROSS_RANK="1", SLURM_PROCID="1",
            CUDA_VISIBLE_DEVICES="5,4",  # slots 1,0 of the allocation's 4,5
        )  # fmt: skip
        assert seen[2]["RANK"] == seen[2]["SLURM_PROCID"] == "2" and seen[2]["LOCAL_RANK"] == "1"
        os.killpg(agent.pid, signal.SIGUSR1)  # a stop, to the whole job
        wait_for(lambda: all((tmp_path / f"term{r}").exists() for r in (1, 2)))
        os.killpg(agent.pid, signal.SIGUSR1)  # again: a parent-death signal may come twice
        time.sleep(0.5)
        # The ranks ignore it and got SIGTERM from the agent; they are given stop_grace_s.
        assert agent.poll() is None
        os.killpg(agent.pid, signal.SIGUSR2)
        assert agent.wait(timeout=20) == 128 + signal.SIGKILL
        out = agent.stdout.read().decode()
        assert out.startswith("neox-agent-ready 1\n")
        report = json.loads(out.split(REPORT_PREFIX, 1)[1])
        assert report["node"] == 1 and report["failure"]["killed_by_agent"] == "deepy.py asked"
    finally:
        agent.kill()
        agent.wait()


def test_rank_0_placed_away_from_master_addr_is_warned_about(caplog):
    from neox.launcher.agent import warn_if_master_elsewhere

    for addr in ("127.0.0.1", "192.0.2.1"):  # here; a documentation address, on no machine
        args = argparse.Namespace(node_rank=0, master_addr=addr, node_rank_env="SLURM_NODEID")
        warn_if_master_elsewhere(args)
    [message] = caplog.messages
    assert "runs rank 0 (SLURM_NODEID=0), but master_addr=192.0.2.1 is not one of" in message


# Rank stand-ins for hang_timeout_s: rank 0 finishes a "step" every 50 ms, rank 1 finishes one
# and is then stuck (as one blocked in a collective, or stopped).
HEARTBEATS = """
import os, sys, time
from pathlib import Path
from neox.launcher.liveness import beat
rank, out = os.environ["RANK"], Path(sys.argv[-1])
(out / f"beat{rank}.tmp").write_text(os.environ["NEOX_HEARTBEAT"])
(out / f"beat{rank}.tmp").rename(out / f"beat{rank}")
beat()
while rank == "0":
    time.sleep(0.05)
    beat()
time.sleep(120)
"""


def test_a_rank_with_no_finished_step_for_hang_timeout_s_is_named_and_the_ranks_killed(tmp_path):
    script = tmp_path / "beats.py"
    script.write_text(HEARTBEATS)
    argv = agent_argv(tmp_path, "", free_port(), control=False)[:-3]
    argv = [*argv[:-1], "--hang_timeout_s=1", argv[-1], str(script), str(tmp_path)]
    r = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=60)
    report = json.loads(r.stdout.split(REPORT_PREFIX, 1)[1])
    failure = report["failure"]
    assert failure["rank"] == 1 and failure["hung"] and failure["status"] == signal.SIGKILL
    assert failure["killed_by_agent"].startswith("rank 1 hung: no finished step for ")
    assert failure["killed_by_agent"].endswith("s, over hang_timeout_s=1")
    assert r.returncode == 128 + signal.SIGKILL
    # The heartbeat files' folder goes with the ranks.
    assert not Path((tmp_path / "beat1").read_text()).parent.exists()


def test_a_rank_past_its_last_step_is_not_timed(tmp_path):
    """A rank that has rested (training over, only leaving left) may take longer than
    hang_timeout_s to leave: the job ends well."""
    script = tmp_path / "rests.py"
    script.write_text(
        "import time\nfrom neox.launcher.liveness import beat, rest\n"
        "beat()\nrest()\ntime.sleep(3)\n"  # 3 x hang_timeout_s
    )
    argv = agent_argv(tmp_path, "", free_port(), control=False)[:-3]
    argv = [*argv[:-1], "--hang_timeout_s=1", argv[-1], str(script), str(tmp_path)]
    r = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.split(REPORT_PREFIX, 1)[1])["failure"] is None
