"""The per-node parent of the ranks: starts them, waits on them, stops them, and dies with deepy.py.

deepy.py starts one agent per node (directly on its own machine, over ssh on the others, or
through mpirun/srun, which start one per node):

python -u -m neox.launcher.agent --node_rank=K --nodes=2,2 --devices=0,1 --master_addr=A
    --master_port=P --stop_grace_s=600 [--hang_timeout_s=S] [--control | --control_fd=N]
    [--report_fd=N] [--tee] -- script.py ARGS...

Under mpirun/srun every node gets the same command: `--node_rank_env=OMPI_COMM_WORLD_RANK` (or
SLURM_NODEID, ...) names where the launcher put the node rank, and `--devices=0,1/0,1` lists
every node's slots. There the stop comes as a signal the launcher passes on: SIGUSR1 (stop) and
SIGUSR2 (kill); mpirun and srun end a job they are sent SIGTERM themselves.

Being the ranks' parent, it learns each rank's exact wait status from os.wait, in the order the
ranks end, so the first failure is known by construction. It reports one line to deepy.py when
its ranks have ended (REPORT_PREFIX + JSON, on --report_fd or stdout). deepy.py's control
channel is the agent's stdin over ssh, or a pipe of its own on deepy's machine (--control_fd;
then the agent's stdin, deepy.py's, is rank 0's, for generate.py's interactive mode): `stop` (SIGTERM to every rank, SIGKILL after stop_grace_s), `kill` (SIGKILL
now); end of file means deepy.py is gone and acts as `stop`, as does the agent's parent dying
(PR_SET_PDEATHSIG) or a SIGTERM/SIGINT to the agent itself (a second one kills the ranks);
SIGUSR1 is always a stop, SIGUSR2 kills them at once.
Each rank is started with PR_SET_PDEATHSIG=SIGKILL, so no rank outlives its agent.
With --hang_timeout_s, a rank with no finished step for that long (its heartbeat file,
neox/launcher/liveness.py) is taken for hung: the agent kills its ranks and reports that rank.
"""

import argparse
import collections
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Optional

from neox.launcher.liveness import HEARTBEAT_ENV, heartbeat_path, stalest
from neox.launcher.process import (
    LAUNCHER_RANK_ENV,
    READY_PREFIX,
    REPORT_PREFIX,
    RankExit,
    child_dies_with_me,
    die_with_parent,
    remove_shm_buffers,
)

log = logging.getLogger("neox.launcher.agent")

TAIL_LINES = 15  # of a failed rank's stderr, in deepy.py's message
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class _Tee:
    """Copies a rank's output to the agent's own, and keeps the last lines. A broken output
    (deepy.py or its ssh gone) drops the copy, never the rank: it must still save."""

    def __init__(self, source: IO[bytes], sink: IO[bytes], keep: int) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=keep)
        self._source, self._sink = source, sink
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sink: Optional[IO[bytes]] = self._sink
        for line in iter(self._source.readline, b""):
            if self.tail.maxlen:
                self.tail.append(line.decode(errors="replace").rstrip("\n"))
            if sink is not None:
                try:
                    sink.write(line)
                    sink.flush()
                except (OSError, ValueError):
                    sink = None


class Agent:
    """One node's ranks: started, signalled and reaped here; the first one to fail."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.host = socket.gethostname()
        self.ranks: dict[int, int] = {}  # pid -> global rank
        self.procs: dict[int, subprocess.Popen] = {}
        self.tees: dict[int, list[_Tee]] = {}
        self.first_failure: Optional[RankExit] = None
        self.stopping = False
        self.termed: set[int] = set()  # ranks sent SIGTERM (a second one is not a stop)
        self.killed_why: Optional[str] = None  # why the agent itself killed its ranks
        self.statuses: dict[int, int] = {}  # pid -> wait status, of the ranks reaped
        self.hung: Optional[int] = None  # pid of the rank taken for hung
        self.heartbeats: Optional[str] = None  # folder of the ranks' heartbeat files
        self.lock = threading.RLock()  # a signal handler may interrupt a holder
        self._timer: Optional[threading.Timer] = None

    # --- starting ------------------------------------------------------------------------------
    def start_ranks(self) -> None:
        a = self.args
        nodes = [int(n) for n in a.nodes.split(",")]
        devices = node_devices(a)
        first = sum(nodes[: a.node_rank])
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=a.master_addr,
            MASTER_PORT=str(a.master_port),
            WORLD_SIZE=str(sum(nodes)),
            CROSS_RANK=str(a.node_rank),
            CROSS_SIZE=str(len(nodes)),
            LOCAL_SIZE=str(len(devices)),
            LOCAL_WORLD_SIZE=str(len(devices)),
        )
        if env.get("DS_ACCELERATOR") != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        if a.hang_timeout_s:
            self.heartbeats = tempfile.mkdtemp(prefix="neox-heartbeat-")
        out = sys.stdout.buffer if a.tee else None
        err = sys.stderr.buffer if a.tee else None
        for local in range(len(devices)):
            rank = first + local
            env.update(RANK=str(rank), LOCAL_RANK=str(local))
            if self.heartbeats:
                env[HEARTBEAT_ENV] = heartbeat_path(self.heartbeats, rank)
            # mpirun's or srun's names for this agent's place, made the rank's own (as if the
            # launcher had started it), for code that reads them.
            for names in LAUNCHER_RANK_ENV.values():
                if names[0] in env:
                    values = (rank, sum(nodes), local, len(devices))
                    env.update({n: str(v) for n, v in zip(names, values) if n})
            cmd = [sys.executable, "-u", a.script, f"--local_rank={local}", *a.script_args]
            proc = subprocess.Popen(
                cmd,
                env=env,
                # deepy.py's stdin reaches rank 0 unless it carries the control channel.
                stdin=None if rank == 0 and a.control_fd is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE if a.tee else None,
                stderr=subprocess.PIPE if a.tee else None,
                preexec_fn=_rank_setup(launched=a.node_rank_env is not None),
            )
            self.ranks[proc.pid] = rank
            self.procs[proc.pid] = proc
            if self.stopping and proc.pid not in self.termed:  # a stop came while it started
                self._signal(signal.SIGTERM)
            if a.tee:
                self.tees[proc.pid] = [
                    _Tee(proc.stdout, out, 0),
                    _Tee(proc.stderr, err, TAIL_LINES),
                ]

    # --- stopping ------------------------------------------------------------------------------
    def stop(self, why: str) -> None:
        """SIGTERM to every rank (they save and exit); SIGKILL to those left after the grace."""
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
        alive = self._signal(signal.SIGTERM)
        log.warning(
            "%s: SIGTERM to %d rank(s) on %s (node %d); killed if still running in %g s",
            why,
            alive,
            self.host,
            self.args.node_rank,
            self.args.stop_grace_s,
        )
        self._timer = threading.Timer(self.args.stop_grace_s, self._overdue)
        self._timer.daemon = True
        self._timer.start()

    def _overdue(self) -> None:
        log.error("ranks still running %g s after the stop: killing them", self.args.stop_grace_s)
        self.kill(f"still running {self.args.stop_grace_s:g} s after the stop")

    def kill(self, why: str) -> None:
        self.killed_why = self.killed_why or why
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> int:
        count = 0
        for proc in list(self.procs.values()):
            if proc.returncode is None and not (sig == signal.SIGTERM and proc.pid in self.termed):
                if sig == signal.SIGTERM:
                    self.termed.add(proc.pid)
                try:
                    os.kill(proc.pid, sig)
                    count += 1
                except ProcessLookupError:
                    pass
        return count

    def on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:  # our parent (deepy.py, or its ssh session) ended
            self.stop("deepy.py is gone (the agent's parent ended)")
        elif signum == signal.SIGUSR2:  # from deepy.py, through mpirun/srun
            self.kill("deepy.py asked")
        elif signum == signal.SIGUSR1:
            # Always a stop, never the second that kills: a parent-death signal comes once per
            # thread of the dead parent, so mpirun/srun may pass on several.
            self.stop("stop requested by deepy.py")
        elif self.stopping:
            log.warning("second %s: killing the ranks now", name)
            self.kill(f"a second {name}")
        else:
            self.stop(f"{name} received")

    def read_control(self) -> None:
        # Unbuffered: a daemon thread blocked here must not hold a lock at interpreter exit.
        fd = 0 if self.args.control_fd is None else self.args.control_fd
        stdin = os.fdopen(fd, "rb", buffering=0, closefd=False)
        for line in iter(stdin.readline, b""):
            command = line.strip()
            if command == b"stop":
                self.stop("stop requested by deepy.py")
            elif command == b"kill":
                self.kill("deepy.py asked")
        self.stop("deepy.py is gone (the control channel closed)")

    def watch_heartbeats(self) -> None:
        """Kill the ranks once one has finished no step for hang_timeout_s (a thread)."""
        timeout = self.args.hang_timeout_s
        while self.first_failure is None:
            time.sleep(min(1.0, timeout / 4))
            if self.stopping or self.killed_why:
                continue  # a stop's save may take long; its grace bounds it
            live = [r for p, r in self.ranks.items() if self.procs[p].returncode is None]
            found = stalest(self.heartbeats, live, timeout)
            if found is not None:
                rank, idle = found
                self.hung = next(p for p, r in self.ranks.items() if r == rank)
                why = (
                    f"rank {rank} hung: no finished step for {idle:.0f} s, over "
                    f"hang_timeout_s={timeout:g}"
                )
                log.error("%s; killing the ranks on %s", why, self.host)
                self.kill(why)
                return

    # --- waiting -------------------------------------------------------------------------------
    def wait(self) -> None:
        """Reap every rank; the first to fail is noted, and the others are killed at once: they
        may be blocked in a collective with it."""
        while any(p.returncode is None for p in self.procs.values()):
            pid, status = os.wait()
            proc = self.procs.get(pid)
            if proc is None:
                continue
            proc.returncode = os.waitstatus_to_exitcode(status)
            self.statuses[pid] = status
            if status != 0 and self.first_failure is None:
                for tee in self.tees.get(pid, []):
                    tee.thread.join(timeout=2)
                tail = list(self.tees[pid][1].tail) if pid in self.tees else []
                why = self.killed_why if status == signal.SIGKILL else None
                rank = self.ranks[pid]
                self.first_failure = RankExit(rank, pid, self.host, status, tail, why)
                self.kill(f"rank {rank} failed")
        if self._timer is not None:
            self._timer.cancel()
        for tees in self.tees.values():
            for tee in tees:
                tee.thread.join(timeout=5)  # a rank's own child may still hold the pipe
        if self.hung is not None:  # name the hung rank, not whichever the kill reaped first
            pid = self.hung
            tail = list(self.tees[pid][1].tail) if pid in self.tees else []
            status = self.statuses[pid]
            self.first_failure = RankExit(self.ranks[pid], pid, self.host, status, tail)
            self.first_failure.killed_by_agent = self.killed_why
        if self.heartbeats:
            shutil.rmtree(self.heartbeats, ignore_errors=True)

    def report(self) -> dict:
        failure = self.first_failure
        return {
            "node": self.args.node_rank,
            "host": self.host,
            "code": failure.exit_code if failure else 0,
            "failure": None
            if failure is None
            else {
                "rank": failure.rank,
                "pid": failure.pid,
                "status": failure.status,
                "tail": failure.tail,
                "killed_by_agent": failure.killed_by_agent,
                "hung": self.hung is not None,
            },
        }


def _rank_setup(launched: bool):
    """A rank's preexec_fn: it dies with the agent; under mpirun/srun it ignores SIGUSR1/SIGUSR2,
    which they deliver to every process of the job (the agent acts on them)."""
    dies = child_dies_with_me(signal.SIGKILL)

    def setup() -> None:
        if launched:
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        dies()

    return setup


def node_devices(args: argparse.Namespace) -> list[str]:
    """This node's device ids. Under mpirun/srun a CUDA_VISIBLE_DEVICES the scheduler set (a
    slurm GPU allocation) is kept: the slots count within it."""
    per_node = args.devices.split("/")
    devices = per_node[args.node_rank if len(per_node) > 1 else 0].split(",")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.node_rank_env and visible and os.environ.get("DS_ACCELERATOR") != "cpu":
        visible_ids = visible.split(",")
        if max(int(d) for d in devices) >= len(visible_ids):
            raise SystemExit(
                f"neox agent: slots {','.join(devices)} of {socket.gethostname()} are not all "
                f"among the GPUs its scheduler gave it (CUDA_VISIBLE_DEVICES={visible}); list "
                f"at most {len(visible_ids)} slots for it in the hostfile"
            )
        devices = [visible_ids[int(d)] for d in devices]
    return devices


def node_rank_from_launcher(args: argparse.Namespace) -> int:
    """The node rank mpirun or srun gave this agent (one process per node)."""
    names = args.node_rank_env.split(",")
    nodes = len(args.nodes.split(","))
    name = next((n for n in names if n in os.environ), None)
    if name is None or not os.environ[name].isdigit() or int(os.environ[name]) >= nodes:
        found = f"{name}={os.environ[name]}" if name else f"none of {', '.join(names)} is set"
        raise SystemExit(
            f"neox agent on {socket.gethostname()}: no node rank below {nodes} from the "
            f"launcher ({found}); it must start exactly one agent per node of the hostfile"
        )
    return int(os.environ[name])


def warn_if_master_elsewhere(args: argparse.Namespace) -> None:
    """Rank 0 serves the rendezvous at master_addr; mpirun/srun chose this node for it by their
    own numbering, which may not put it on master_addr's host (the ranks would then wait)."""
    if args.node_rank != 0:
        return
    try:
        with socket.socket() as s:
            s.bind((args.master_addr, 0))
    except OSError:
        log.warning(
            "WARNING: this node (%s) runs rank 0 (%s=0), but master_addr=%s is not one of its "
            "addresses, so the other ranks look for rank 0 there; set master_addr to this "
            "node, or list the hostfile in the launcher's node order",
            socket.gethostname(),
            args.node_rank_env,
            args.master_addr,
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m neox.launcher.agent", description=__doc__)
    place = p.add_mutually_exclusive_group(required=True)
    place.add_argument("--node_rank", type=int, help="this node's place in --nodes")
    place.add_argument(
        "--node_rank_env",
        help="where mpirun/srun put this node's place (first set of a comma list)",
    )
    p.add_argument("--nodes", required=True, help="ranks on each node, in node order: 4,4")
    p.add_argument(
        "--devices",
        required=True,
        help="this node's device (slot) ids: 0,1,2,3; or every node's, in node order: 0,1/0,1",
    )
    p.add_argument("--master_addr", required=True)
    p.add_argument("--master_port", type=int, required=True)
    p.add_argument("--stop_grace_s", type=float, required=True)
    p.add_argument(
        "--hang_timeout_s",
        type=float,
        default=None,
        help="kill the ranks once one has finished no step for this long",
    )
    p.add_argument("--report_fd", type=int, default=None, help="default: stdout")
    p.add_argument("--tee", action="store_true", help="relay the ranks' output, keep its tail")
    p.add_argument("--control", action="store_true", help="read stop/kill from stdin")
    p.add_argument(
        "--control_fd",
        type=int,
        default=None,
        help="read stop/kill from this fd (stdin is rank 0's)",
    )
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="neox agent: %(message)s")
    args = parse_args(argv)
    report_to = os.fdopen(args.report_fd, "w") if args.report_fd is not None else sys.stdout
    agent = Agent(args)
    for sig in HANDLED:
        signal.signal(sig, agent.on_signal)
    # Our parent is deepy.py (which set this before exec too), the ssh session it opened, or
    # mpirun's/srun's daemon: SIGHUP when it ends, however it ends.
    die_with_parent(signal.SIGHUP, os.getppid())
    if args.node_rank_env:
        args.node_rank = node_rank_from_launcher(args)
        warn_if_master_elsewhere(args)
    agent.start_ranks()
    if args.hang_timeout_s:
        threading.Thread(target=agent.watch_heartbeats, daemon=True).start()
    if args.control or args.control_fd is not None:
        threading.Thread(target=agent.read_control, daemon=True).start()
    if args.node_rank_env:
        print(f"{READY_PREFIX}{args.node_rank}", file=report_to, flush=True)
    agent.wait()
    # Its ranks have ended: a late stop or kill (mpirun and srun may deliver one twice) must not
    # end the agent before it reports. Python restores fatal defaults at exit, but keeps ignores.
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)
    remove_shm_buffers(args.master_port)
    report = agent.report()
    try:
        print(REPORT_PREFIX + json.dumps(report), file=report_to, flush=True)
    except OSError:
        pass  # deepy.py is gone: nobody to tell
    return report["code"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
