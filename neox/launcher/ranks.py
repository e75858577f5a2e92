"""Watch the ranks DeepSpeed's launch.py starts on this node: who they are, who died first, how.

DeepSpeed reports a dead rank only as its whole command line (a 1.6 KB base64 argument) and the
return code, and takes up to 30 s per rank to stop the others. Watching the ranks from deepy.py
names the rank, and lets the launch stop the rest at once.
"""

import os
import signal
import socket
from dataclasses import dataclass
from typing import Optional

import psutil

# The per-node launcher whose children are the ranks.
_LAUNCH_MODULE = "deepspeed.launcher.launch"


@dataclass
class RankExit:
    rank: int
    pid: int
    host: str
    status: int  # wait status as the kernel reports it

    def describe(self) -> str:
        if self.status & 0x7F:
            sig = self.status & 0x7F
            name = {s.value: s.name for s in signal.Signals}.get(sig, "a real-time signal")
            how = f"was killed by {name} (signal {sig}"
            how += "; the kernel's OOM killer sends SIGKILL)" if sig == signal.SIGKILL else ")"
        else:
            how = f"exited with status {self.status >> 8}"
        return f"rank {self.rank} on {self.host} (pid {self.pid}) {how}"

    @property
    def exit_code(self) -> int:
        """The status a shell would report for it."""
        return 128 + (self.status & 0x7F) if self.status & 0x7F else self.status >> 8


def _exit_status(pid: int) -> Optional[int]:
    """The wait status of a zombie, from /proc/PID/stat's last field (Linux 3.5+)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] != "Z":
        return None
    return int(fields[-1])


class RankWatch:
    """Polled by the launch loop: learns the local ranks' pids, and notes the first one to end
    with a failure before the launcher has reaped it."""

    def __init__(self, runner_pid: int, world_size: int) -> None:
        self.runner_pid = runner_pid
        self.world_size = world_size
        self.host = socket.gethostname()
        self.ranks: dict[int, int] = {}  # pid -> rank
        self.vanished: list[int] = []  # pids reaped before a poll saw them dead, in order
        self.first_failure: Optional[RankExit] = None
        self.stop_signal: Optional[int] = None  # sent to every rank, also to ranks started later
        self._signalled: set[int] = set()

    def poll(self) -> Optional[RankExit]:
        """Update the rank table; returns the first failed rank once it is known."""
        self._find_ranks()
        if self.stop_signal is not None:
            self._signal_new_ranks()
        if self.first_failure is None:
            # Only a zombie tells its exit status; a rank already reaped by launch.py is noted as
            # vanished, for settle(). When several are seen dead at once, one killed by a signal
            # is the likelier cause: the others then fail on its closed connections.
            dead = [
                RankExit(rank, pid, self.host, status)
                for pid, rank in self.ranks.items()
                if (status := _exit_status(pid))
            ]
            if dead:
                self.first_failure = min(dead, key=lambda d: (not d.status & 0x7F, d.rank))
            gone = [p for p in self.ranks if p not in self.vanished and not psutil.pid_exists(p)]
            self.vanished += sorted(gone, key=self.ranks.__getitem__)
        return self.first_failure

    def settle(self, launch_code: int) -> Optional[RankExit]:
        """The first failed rank, once launch.py has exited with launch_code.

        launch.py polls its ranks once a second and exits with the status of the first failed
        one it reaps (a rank's -N as 256-N), after reaping the rest. A rank it reaped before a
        poll here saw it dead is therefore the first failure when launch.py's status is not that
        of the rank seen dead here; its status is then the one launch.py reported.
        """
        if launch_code == 0 or not self.vanished:
            return self.first_failure
        status = 256 - launch_code if launch_code > 128 + 64 else launch_code << 8
        seen = self.first_failure
        if seen is not None and seen.status == status:
            return seen
        pid = self.vanished[0]
        return RankExit(self.ranks[pid], pid, self.host, status)

    def signal_ranks(self, sig: int) -> None:
        """Send sig to every local rank (not to DeepSpeed's launcher, which would kill them),
        and to those started later: a stop asked for during the launch reaches them too."""
        self.stop_signal = sig
        self._find_ranks()
        self._signal_new_ranks()

    def _find_ranks(self) -> None:
        # Finding the ranks walks the process tree: only until all of them are known.
        for proc in self._rank_processes() if len(self.ranks) < self.world_size else []:
            if proc.pid not in self.ranks:
                try:
                    # Between fork and exec a child still shows launch.py's command line and
                    # environment (no RANK): it is learnt at a later poll, once it has exec'd.
                    if _LAUNCH_MODULE in proc.cmdline():
                        continue
                    rank = proc.environ().get("RANK")
                    if rank is not None:
                        self.ranks[proc.pid] = int(rank)
                except (psutil.Error, ValueError):
                    continue

    def _signal_new_ranks(self) -> None:
        for pid in self.ranks.keys() - self._signalled:
            self._signalled.add(pid)
            try:
                os.kill(pid, self.stop_signal)
            except OSError:
                pass

    def _rank_processes(self) -> list[psutil.Process]:
        try:
            tree = psutil.Process(self.runner_pid).children(recursive=True)
        except psutil.Error:
            return []
        ranks = []
        for proc in tree:
            try:
                if _LAUNCH_MODULE in proc.cmdline():
                    ranks += proc.children()
            except psutil.Error:
                continue
        return ranks
