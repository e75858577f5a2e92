"""Run a LaunchPlan: start each node's agent (here, over ssh, or through mpirun/srun), pass stop
signals on, and end every node when one of them fails.

Every process started here is this process's child, with PR_SET_PDEATHSIG: a kill -9 of deepy.py
ends the local agent (which stops its ranks as on SIGTERM: they save) and the ssh clients, whose
remote agents see their control channel close and stop the same way; mpirun or srun get SIGUSR1,
the stop they pass on to every agent.
"""

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Optional

from neox.launcher.plan import LaunchPlan
from neox.launcher.process import (
    INPUT_ERROR_EXIT,
    READY_PREFIX,
    REPORT_PREFIX,
    RankExit,
    child_dies_with_me,
)
from neox.launcher.signals import AbortLaunch, StopRequest

log = logging.getLogger(__name__)

# deepy.py's exit status when a stop killed the ranks unsaved (128 + SIGKILL, what they got):
# distinct from a clean stop's 0 (SIGTERM) or 130 (Ctrl-C), after which a checkpoint exists.
KILLED_EXIT = 128 + signal.SIGKILL
# What mpirun and srun pass on to every agent (they end the job themselves on SIGTERM/SIGINT).
LAUNCHER_SIGNALS = {"stop": signal.SIGUSR1, "kill": signal.SIGUSR2}


@dataclass
class LaunchResult:
    code: int  # exit status for deepy.py to return
    signal: Optional[int]  # the (first) stop signal deepy.py received, if any
    # The ranks were killed before they could save (a second stop signal). Whatever `latest`
    # names was saved before the stop.
    killed: bool = False
    # The first failure, as deepy.py named it, and whether a relaunch may get past it.
    failure: Optional[str] = None
    retry: bool = False


class _Node:
    """One process deepy.py started (a local agent, an ssh client running a node's agent, or
    mpirun/srun running one agent on each node), the reports its agents send when their ranks
    have ended, and how it ended."""

    def __init__(self, plan: LaunchPlan, index: int, argv: list[str], events: queue.Queue):
        by_launcher = plan.agents_by_launcher
        self.kind = "launcher" if by_launcher else {"local": "agent"}.get(plan.launcher, "ssh")
        self.host = argv[0] if by_launcher else list(plan.hosts)[index]
        self.agents = len(plan.hosts) if by_launcher else 1
        self.reports: list[dict] = []
        self.ready = 0  # agents of mpirun/srun that have started their ranks
        self.pending: Optional[str] = None  # a stop for agents not all ready yet
        self.code: Optional[int] = None
        self._events = events
        self._lock = threading.RLock()  # send() runs in signal handlers and the reader
        source = relay = None
        pass_fds: tuple[int, ...] = ()
        stdin = subprocess.DEVNULL if by_launcher else subprocess.PIPE
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
            # Over ssh and mpirun/srun the reports come on stdout, with the ranks' output.
            stdout=None if self.kind == "agent" else subprocess.PIPE,
            pass_fds=pass_fds,
            # Its own session: a terminal's Ctrl-C reaches deepy.py only, which passes it on.
            start_new_session=True,
            preexec_fn=child_dies_with_me(
                LAUNCHER_SIGNALS["stop"] if by_launcher else signal.SIGHUP
            ),
        )
        # The agent's control channel: its own pipe locally, its stdin over ssh.
        self.control: Optional[IO[bytes]] = self.proc.stdin
        if self.kind == "agent":
            for fd in pass_fds:
                os.close(fd)
            self.control = os.fdopen(control_w, "wb")
        else:
            source, relay = self.proc.stdout, getattr(sys.stdout, "buffer", None)
        self.reader = threading.Thread(target=self._read, args=(source, relay), daemon=True)
        self.reader.start()

    def _read(self, source: IO[bytes], relay: Optional[IO[bytes]]) -> None:
        report, ready = REPORT_PREFIX.encode(), READY_PREFIX.encode()
        for line in iter(source.readline, b""):
            if line.startswith(report):
                self.reports.append(json.loads(line[len(report) :]))
                if self.reports[-1]["failure"] is not None:
                    self._events.put((self, None))  # name it now: other nodes may hang
            elif line.startswith(ready):
                with self._lock:
                    self.ready += 1
                    if self.ready == self.agents and self.pending:
                        self.send(self.pending)
            elif relay is not None:
                try:
                    relay.write(line)
                    relay.flush()
                except (OSError, ValueError):
                    relay = None  # our own output is gone; the report still matters

    def send(self, command: str) -> None:
        """`stop` or `kill` to this node's agents: a line on the control channel (over ssh, the
        remote agent's stdin), or a signal mpirun/srun pass on to every agent."""
        with self._lock:
            if self.code is not None:
                return
            if self.kind == "launcher":
                if command == "stop" and self.ready < self.agents:
                    self.pending = command  # an agent without its ranks yet would just die
                    return
                self.pending = None
                try:
                    os.kill(self.proc.pid, LAUNCHER_SIGNALS[command])
                except ProcessLookupError:
                    pass
                return
            try:
                self.control.write(command.encode() + b"\n")
                self.control.flush()
            except (BrokenPipeError, ValueError):
                pass

    def _bad_report(self) -> Optional[dict]:
        return next((r for r in self.reports if r["failure"] is not None), None)

    def failure(self) -> Optional[str]:
        """What went wrong on this node (or mpirun's/srun's nodes), in one message; None while
        it runs without a failure, or when its ranks all exited 0."""
        report = self._bad_report()
        if report is not None:
            bad = report["failure"]
            rank = RankExit(
                bad["rank"],
                bad["pid"],
                report["host"],
                bad["status"],
                killed_by_agent=bad["killed_by_agent"],
            )
            text = rank.describe()
            if bad["tail"]:
                text += "; the end of its stderr:\n  " + "\n  ".join(bad["tail"])
            return text
        if self.code is None or self.code == 0 or len(self.reports) == self.agents:
            return None
        if self.kind == "launcher":
            return (
                f"{self.host} ended with status {self.code} and reports from "
                f"{len(self.reports)} of its {self.agents} agents"
            )
        what = "ssh to " if self.kind == "ssh" else "the agent on "
        return f"{what}{self.host} ended with status {self.code} and no report from the agent"

    def retryable(self) -> bool:
        """A failure a relaunch may get past: a rank that died or hung, a node lost without a
        report; not a rank's exit 2 (a config or checkpoint error: it would recur)."""
        report = self._bad_report()
        return report is None or report["code"] != INPUT_ERROR_EXIT

    @property
    def exit_code(self) -> int:
        report = self._bad_report()
        if report is not None:
            return report["code"]
        return 0 if len(self.reports) == self.agents else self.code or 0


def launch(
    plan: LaunchPlan,
    config_at: str | None = None,
    on_stop: Optional[Callable[[], None]] = None,
) -> LaunchResult:
    """Start the plan and wait until every node has ended.

    A failed rank is named (rank, host, pid, status, the end of its stderr when it was piped)
    and every other node is told to kill its ranks at once. A first SIGTERM/SIGINT is passed
    to every agent, whose ranks save and exit (killed after stop_grace_s); a second kills them,
    reported as `killed` and exit status KILLED_EXIT, so that no one takes it for a clean stop
    that saved. `config_at`: where the ranks write the full config, for the launch line.
    `on_stop` runs once, when the first stop signal is passed on.
    """
    log.info(
        "launching %d rank(s) on %s, run %s (master port %d); full config: %s",
        plan.world_size,
        ", ".join(plan.hosts),
        plan.launch_id[:8],
        plan.master_port,
        config_at or "deepy.py --dry-run prints it",
    )
    log.debug("launch command: %s", plan.command)  # the config in it is one base64 argument
    events: queue.Queue = queue.Queue()  # (node, exit status), or (node, None): a failure report
    nodes: list[_Node] = []

    def start() -> None:
        for i, argv in enumerate(plan.argvs):
            node = _Node(plan, i, argv, events)
            nodes.append(node)
            if stop.signum is not None:  # a stop that came while the nodes start
                node.send("stop")
            threading.Thread(
                target=lambda n=node: events.put((n, n.proc.wait())), daemon=True
            ).start()

    def forward() -> None:
        if on_stop is not None:
            on_stop()
        for node in nodes:
            node.send("stop")

    stop = StopRequest(forward)
    code, failure, retry = 0, None, False
    killed = False
    try:
        with stop:
            start()
            code, failure, retry = _wait(nodes, events)
    except AbortLaunch as e:
        log.error("%s", e)
        _kill(nodes)
        code, killed = KILLED_EXIT, True
    except BaseException:
        log.error("launch interrupted; stopping all ranks")
        _kill(nodes)
        raise
    if stop.signum is not None and code == 0:
        code = stop.exit_code
    return LaunchResult(code, stop.signum, killed, failure, retry and stop.signum is None)


def _wait(nodes: list[_Node], events: queue.Queue) -> tuple[int, Optional[str], bool]:
    """Wait for every node; the first failure reported is named and every node told to kill.
    Returns the exit status, that failure and whether a relaunch may get past it."""
    code, retry = 0, False
    first: Optional[str] = None
    left = len(nodes)
    while left:
        try:
            node, status = events.get(timeout=1.0)  # the timeout lets signal handlers run
        except queue.Empty:
            continue
        if status is not None:  # the process ended
            left -= 1
            node.code = 128 - status if status < 0 else status
            node.reader.join(timeout=10)  # the report is the agents' last line
        failure = node.failure()
        if failure is not None and first is None:
            first = failure
            code, retry = node.exit_code or 1, node.retryable()
            others = " and the other nodes" if len(nodes) > 1 or node.agents > 1 else ""
            log.error("%s; stopping the other ranks%s", failure, others)
            for other in nodes:
                other.send("kill")
    return code, first, retry


def _kill(nodes: list[_Node]) -> None:
    """Kill every rank now: agents are told to, then the processes deepy.py started are killed
    if they have not ended within 10 s (a local agent takes its ranks with it)."""
    for node in nodes:
        node.send("kill")
    for node in nodes:
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.proc.wait()
