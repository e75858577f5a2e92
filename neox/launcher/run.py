"""Run a LaunchPlan: start each node's agent (or DeepSpeed's runner for mpirun/srun), pass stop
signals on, and end every node when one of them fails.

Every process started here is this process's child, with PR_SET_PDEATHSIG: a kill -9 of deepy.py
ends the local agent (which stops its ranks as on SIGTERM: they save) and the ssh clients, whose
remote agents see their control channel close and stop the same way.
"""

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, Optional

from neox.launcher.plan import LaunchPlan
from neox.launcher.process import (
    REPORT_PREFIX,
    RankExit,
    child_dies_with_me,
    remove_shm_buffers,
)
from neox.launcher.signals import AbortLaunch, StopRequest

log = logging.getLogger(__name__)

# deepy.py's exit status when a stop killed the ranks unsaved (128 + SIGKILL, what they got):
# distinct from a clean stop's 0 (SIGTERM) or 130 (Ctrl-C), after which a checkpoint exists.
KILLED_EXIT = 128 + signal.SIGKILL


@dataclass
class LaunchResult:
    code: int  # exit status for deepy.py to return
    signal: Optional[int]  # the (first) stop signal deepy.py received, if any
    # The ranks were killed before they could save: a second stop signal, or a stop on an
    # mpirun/srun launch. Whatever `latest` names was saved before the stop.
    killed: bool = False


class _Node:
    """One process deepy.py started (a local agent, an ssh client running a node's agent, or
    DeepSpeed's runner), the report the agent sends when its ranks have ended, and how it ended."""

    def __init__(self, plan: LaunchPlan, index: int, argv: list[str], env_fd: Optional[int]):
        self.host = list(plan.hosts)[index] if plan.agents else ""
        self.kind = {"local": "agent", "pdsh": "ssh"}.get(plan.launcher, "runner")
        self.report: Optional[dict] = None
        self.code: Optional[int] = None
        source = relay = None
        pass_fds: tuple[int, ...] = () if env_fd is None else (env_fd,)
        stdin = subprocess.PIPE if plan.agents else subprocess.DEVNULL
        if self.kind == "agent":
            # Its output is deepy.py's own (a terminal keeps its progress bar); the report and
            # the control channel are pipes of their own, so that deepy.py's stdin reaches rank 0
            # (generate.py's interactive mode reads it).
            source_fd, report_fd = os.pipe()
            control_fd, control_w = os.pipe()
            extra = [f"--report_fd={report_fd}", f"--control_fd={control_fd}"]
            if not os.isatty(2):  # on a terminal the traceback is right above deepy's message
                extra.append("--tee")
            argv = argv[:4] + extra + argv[4:]
            source, pass_fds = os.fdopen(source_fd, "rb"), (report_fd, control_fd)
            stdin = None
        self.proc = subprocess.Popen(
            argv,
            env=plan.env,
            cwd=plan.cwd,
            stdin=stdin,
            # Over ssh the report comes on stdout, with the ranks' output (relayed here).
            stdout=subprocess.PIPE if self.kind == "ssh" else None,
            pass_fds=pass_fds,
            # Its own session: a terminal's Ctrl-C reaches deepy.py only, which passes it on.
            start_new_session=True,
            preexec_fn=child_dies_with_me(signal.SIGHUP if plan.agents else signal.SIGTERM),
        )
        # The agent's control channel: its own pipe locally, its stdin over ssh.
        self.control: Optional[IO[bytes]] = self.proc.stdin
        if self.kind == "agent":
            for fd in pass_fds:
                os.close(fd)
            self.control = os.fdopen(control_w, "wb")
        elif self.kind == "ssh":
            source, relay = self.proc.stdout, getattr(sys.stdout, "buffer", None)
        self.reader = None
        if source is not None:
            self.reader = threading.Thread(target=self._read, args=(source, relay), daemon=True)
            self.reader.start()

    def _read(self, source: IO[bytes], relay: Optional[IO[bytes]]) -> None:
        prefix = REPORT_PREFIX.encode()
        for line in iter(source.readline, b""):
            if line.startswith(prefix):
                self.report = json.loads(line[len(prefix) :])
            elif relay is not None:
                try:
                    relay.write(line)
                    relay.flush()
                except (OSError, ValueError):
                    relay = None  # our own output is gone; the report still matters

    def send(self, command: str) -> None:
        """A line on the agent's control channel (over ssh, the remote agent's stdin)."""
        if self.control is None or self.code is not None:
            return
        try:
            self.control.write(command.encode() + b"\n")
            self.control.flush()
        except (BrokenPipeError, ValueError):
            pass

    def failure(self) -> Optional[str]:
        """What went wrong on this node, in one message; None when its ranks all exited 0."""
        if self.report is not None:
            bad = self.report["failure"]
            if bad is None:
                return None
            rank = RankExit(
                bad["rank"],
                bad["pid"],
                self.report["host"],
                bad["status"],
                killed_by_agent=bad["killed_by_agent"],
            )
            text = rank.describe()
            if bad["tail"]:
                text += "; the end of its stderr:\n  " + "\n  ".join(bad["tail"])
            return text
        if self.code == 0:
            return None
        if self.kind == "runner":
            return f"DeepSpeed's runner (mpirun/srun) exited with status {self.code}"
        what = "ssh to " if self.kind == "ssh" else "the agent on "
        return f"{what}{self.host} ended with status {self.code} and no report from the agent"

    @property
    def exit_code(self) -> int:
        if self.report is not None:
            return self.report["code"]
        return self.code or 0


def launch(plan: LaunchPlan) -> LaunchResult:
    """Start the plan and wait until every node has ended.

    A failed rank is named (rank, host, pid, status, the end of its stderr when it was piped)
    and every other node is told to kill its ranks at once. A first SIGTERM/SIGINT is passed
    to every agent, whose ranks save and exit (killed after stop_grace_s); a second kills them.
    mpirun and srun launches are stopped unsaved. A kill is reported as `killed` and exit
    status KILLED_EXIT, so that no one takes it for a clean stop that saved.
    """
    env_fd = None
    if plan.env_file_text:
        # DeepSpeed's runner reads the exports from DS_ENV_FILE. A memfd is a file no run can
        # leave behind (DeepSpeed joins an absolute path to ~ and ., which keeps it as is).
        env_fd = os.memfd_create("neox-deepspeed-env", 0)
        os.write(env_fd, plan.env_file_text.encode())
        plan.env["DS_ENV_FILE"] = f"/proc/self/fd/{env_fd}"
    log.info("launching %d rank(s) on %s: %s", plan.world_size, ", ".join(plan.hosts), plan.command)
    ended: queue.Queue = queue.Queue()
    nodes: list[_Node] = []

    def start() -> None:
        for i, argv in enumerate(plan.argvs):
            node = _Node(plan, i, argv, env_fd)
            nodes.append(node)
            if stop.signum is not None:  # a stop that came while the nodes start
                node.send("stop")
            threading.Thread(
                target=lambda n=node: ended.put((n, n.proc.wait())), daemon=True
            ).start()

    def forward() -> None:
        if not plan.agents:
            raise AbortLaunch(
                f"stop signal on a {plan.launcher} launch: stopping every rank, unsaved (only "
                "local and ssh launches pass it on; a scheduler may signal the ranks themselves "
                "to save)"
            )
        for node in nodes:
            node.send("stop")

    stop = StopRequest(forward)
    code = 0
    killed = False
    try:
        with stop:
            start()
            code = _wait(nodes, ended)
    except AbortLaunch as e:
        log.error("%s", e)
        _kill(nodes)
        code, killed = KILLED_EXIT, True
    except BaseException:
        log.error("launch interrupted; stopping all ranks")
        _kill(nodes)
        raise
    finally:
        if env_fd is not None:
            os.close(env_fd)
            # No agent cleans up after mpirun's or srun's ranks: those on this machine, here.
            remove_shm_buffers(plan.master_port)
    if stop.signum is not None and code == 0:
        code = stop.exit_code
    return LaunchResult(code, stop.signum, killed)


def _wait(nodes: list[_Node], ended: queue.Queue) -> int:
    """Wait for every node; the first to report a failure is named and the others killed."""
    code = 0
    first: Optional[str] = None
    left = len(nodes)
    while left:
        try:
            node, status = ended.get(timeout=1.0)  # the timeout lets signal handlers run
        except queue.Empty:
            continue
        left -= 1
        node.code = 128 - status if status < 0 else status
        if node.reader is not None:
            node.reader.join(timeout=10)  # the report is the agent's last line
        failure = node.failure()
        if failure is not None and first is None:
            first = failure
            code = node.exit_code or 1
            others = " and the other nodes" if len(nodes) > 1 else ""
            log.error("%s; stopping the other ranks%s", failure, others)
            for other in nodes:
                other.send("kill")
    return code


def _kill(nodes: list[_Node]) -> None:
    """Kill every rank now: agents are told to, then their processes are killed (a local agent
    takes its ranks with it; a runner's process group is ended)."""
    for node in nodes:
        node.send("kill")
    for node in nodes:
        if node.kind == "runner":
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.proc.wait()
