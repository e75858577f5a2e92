"""Run a LaunchPlan through DeepSpeed's runner, and stop every node when one of them fails."""

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

import psutil

from neox.launcher import reap
from neox.launcher.plan import LAUNCH_ID_ENV, LaunchPlan
from neox.launcher.ranks import RankWatch
from neox.launcher.signals import AbortLaunch, StopRequest

log = logging.getLogger(__name__)

# pdsh reports each node's ssh as it ends: "pdsh@me: worker-1: ssh exited with exit code 1".
_NODE_FAILED = re.compile(rb"^pdsh@[^:]*: (?P<host>[^:]+): ssh exited with exit code (?P<code>\d+)")


class _NodeWatch:
    """Relays pdsh's stderr and notes the first node whose command exited non-zero."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.failed: Optional[tuple[str, int]] = None
        self.failed_at: Optional[float] = None
        self._stream = stream
        self.thread = threading.Thread(target=self._relay, name="neox-pdsh-watch", daemon=True)
        self.thread.start()

    def _relay(self) -> None:
        out = getattr(sys.stderr, "buffer", None)
        for line in iter(self._stream.readline, b""):
            if out is not None:
                out.write(line)
                out.flush()
            else:
                sys.stderr.write(line.decode(errors="replace"))
            match = _NODE_FAILED.match(line)
            if match and self.failed is None:
                self.failed = (match["host"].decode(), int(match["code"]))
                self.failed_at = time.monotonic()


@dataclass
class LaunchResult:
    code: int  # exit status for deepy.py to return
    signal: Optional[int]  # the stop signal deepy.py received, if any


def launch(plan: LaunchPlan, *, grace_s: float = 5.0) -> LaunchResult:
    """Start the plan and wait until every rank has ended.

    A local rank that fails is named (rank, host, pid, status) and the others are stopped at
    once. A first SIGTERM/SIGINT is passed to the ranks (over pdsh: by a second pdsh command),
    which save and exit; a second one kills them. DeepSpeed's launch.py already ends a node's
    other ranks when one of them fails, but nothing tells the other nodes: with pdsh they would
    wait in a collective until its timeout. So when pdsh reports a failed node, the remaining
    nodes get grace_s seconds to fail on their own, then every process of this launch is ended
    on every node.
    """
    env = dict(plan.env)
    with tempfile.TemporaryDirectory(prefix="neox-launch-") as tmp:
        if plan.multi_node:
            # DeepSpeed joins DS_ENV_FILE to ~ and to ., so an absolute path is read as is and the
            # user's own .deepspeed_env (merged into env_file_text by the plan) stays untouched.
            env_file = Path(tmp, "deepspeed_env")
            env_file.write_text(plan.env_file_text)
            env["DS_ENV_FILE"] = str(env_file)
        log.info(
            "launching %d rank(s) on %s: %s", plan.world_size, ", ".join(plan.hosts), plan.command
        )
        watched = plan.launcher == "pdsh"
        # Its own session, so the runner and everything under it can be ended by process group.
        proc = subprocess.Popen(
            plan.argv,
            env=env,
            cwd=plan.cwd,
            start_new_session=True,
            stderr=subprocess.PIPE if watched else None,
        )
        watch = _NodeWatch(proc.stderr) if watched else None
        ranks = None if plan.multi_node else RankWatch(proc.pid, plan.world_size)
        stop = StopRequest(lambda: _forward_stop(plan, proc, ranks))
        try:
            with stop:
                code = _wait(proc, watch, ranks, grace_s)
        except AbortLaunch as e:
            log.error("%s", e)
            if plan.launcher == "pdsh":
                _stop(plan, proc)
            else:
                _signal_group(proc, signal.SIGKILL)
            code = 128 + (stop.signum or signal.SIGTERM)
        except BaseException:
            log.error("launch interrupted; stopping all ranks")
            _stop(plan, proc)
            raise
        if proc.poll() is None:
            _stop(plan, proc)
        if watch is not None:
            watch.thread.join(timeout=5)
        if ranks is not None and ranks.first_failure is None and code != 0:
            # launch.py exited before a poll here saw its failed rank: name it from the status.
            missed = ranks.settle(code)
            if missed is not None:
                log.error("%s", missed.describe())
                code = missed.exit_code
        if not plan.multi_node:
            # Whatever outlived the runner (a rank whose launcher died first) goes now.
            reap.reap(plan.launch_id, grace_s=2)
            _remove_shm_buffers(plan)
        if stop.signum is not None and code == 0:
            code = stop.exit_code
        return LaunchResult(code, stop.signum)


def _remove_shm_buffers(plan: LaunchPlan) -> None:
    """DeepSpeed's CPU all-reduce leaves a 69 MB buffer per rank in /dev/shm, named by the master
    port, and never removes it: runs on free ports would fill the machine's memory."""
    ports = [a.split("=", 1)[1] for a in plan.argv if a.startswith("--master_port=")]
    for port in ports:
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            path.unlink(missing_ok=True)


def _forward_stop(plan: LaunchPlan, proc: subprocess.Popen, ranks: Optional[RankWatch]) -> None:
    if ranks is not None:
        # The ranks, not DeepSpeed's launch.py: its handler gives each rank 30 s, one by one.
        ranks.signal_ranks(signal.SIGTERM)
    elif plan.launcher == "pdsh":
        # pdsh passes no signal on; a second pdsh signals this launch's ranks on every node.
        # In a thread: a second signal must still find the waiting loop responsive.
        threading.Thread(
            target=_run_reaper, args=(plan, "ranks", "%n"), name="neox-pdsh-stop", daemon=True
        ).start()
    else:
        raise AbortLaunch(
            f"stop signal on a {plan.launcher} launch: stopping every rank, unsaved (only local "
            "and pdsh launches pass it on; a scheduler may signal the ranks themselves to save)"
        )


def _wait(
    proc: subprocess.Popen,
    watch: Optional[_NodeWatch],
    ranks: Optional[RankWatch],
    grace_s: float,
) -> int:
    while True:
        try:
            code = proc.wait(timeout=0.05)  # a dead rank is a zombie until launch.py polls
            break
        except subprocess.TimeoutExpired:
            pass
        failed = ranks.poll() if ranks is not None else None
        if failed is not None:
            if ranks.vanished:
                # A rank launch.py reaped before a poll saw it may have died first: launch.py
                # names it by its exit status, once it has ended the others (about a second).
                try:
                    failed = ranks.settle(_shell_status(proc.wait(timeout=3)))
                except subprocess.TimeoutExpired:
                    pass
            # The others may be blocked in a collective with the dead rank: end them now.
            log.error("%s; stopping the other ranks", failed.describe())
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            return failed.exit_code
        if watch is not None and watch.failed_at is not None:
            if time.monotonic() - watch.failed_at > grace_s:
                host, failed_code = watch.failed
                log.error(
                    "node %s exited with code %d and the other nodes are still running "
                    "after %.0f s; stopping them",
                    host,
                    failed_code,
                    grace_s,
                )
                return failed_code or 1
    if watch is not None and watch.failed is not None and code == 0:
        code = watch.failed[1]
    return _shell_status(code)


def _shell_status(code: int) -> int:
    # A runner killed by a signal reports -N; shells say 128+N, and 0 must never mean failure.
    return 128 - code if code < 0 else code


def _stop(plan: LaunchPlan, proc: subprocess.Popen) -> None:
    """End the runner's process group here and, over pdsh, this launch's ranks on every node."""
    if plan.launcher == "pdsh":
        # SIGKILL, because the runner's SIGTERM handler runs `pkill -f` on DeepSpeed's launcher
        # name on every node, which would also end unrelated jobs there. pdsh puts its ssh
        # clients in sessions of their own, so they are found by parentage, not process group.
        try:
            local = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            local = []
        _signal_group(proc, signal.SIGKILL)
        for child in local:
            try:
                child.kill()
            except psutil.Error:
                pass
        _run_reaper(plan)
    else:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _run_reaper(plan: LaunchPlan, *mode: str) -> None:
    """Run reap.py for this launch on every node over pdsh (mode "ranks", "%n": SIGTERM the
    ranks; pdsh puts each host's node rank for %n, as in DeepSpeed's own command)."""
    what = "signalling" if mode else "ending"
    env = dict(plan.env, PDSH_RCMD_TYPE="ssh")
    env.pop(LAUNCH_ID_ENV, None)  # else the reaper on this machine would end its own pdsh
    if plan.ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {plan.ssh_port}"
    # pdsh joins its arguments into one remote shell command, hence the quoting.
    remote = [sys.executable, "-c", Path(reap.__file__).read_text(), plan.launch_id, *mode]
    cmd = ["pdsh", "-S", "-w", ",".join(plan.hosts), " ".join(shlex.quote(a) for a in remote)]
    try:
        result = subprocess.run(cmd, env=env, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        log.error("%s the ranks on %s: pdsh timed out", what, ", ".join(plan.hosts))
        return
    output = (result.stdout + result.stderr).decode(errors="replace").strip()
    if result.returncode != 0:
        log.error(
            "%s the ranks on %s failed (pdsh exit code %d): %s",
            what,
            ", ".join(plan.hosts),
            result.returncode,
            output,
        )
    elif mode:
        log.info("%s", "; ".join(output.splitlines()))
