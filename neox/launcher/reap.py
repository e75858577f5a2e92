"""End, or ask to stop, the processes on this node whose environment carries one launch's
NEOX_LAUNCH_ID.

Standard library only: run_launch sends this file's source to each node as `python -c` over pdsh,
so it needs nothing installed there. Matching the unique id, not a command name, keeps other jobs
on a shared node alive (DeepSpeed's own cleanup is `pkill -f` on the launcher's name).

python -c "$(cat reap.py)" LAUNCH_ID               end every process of the launch
python -c "$(cat reap.py)" LAUNCH_ID ranks NODE    SIGTERM the ranks of node rank NODE: they
                                                   save and exit
This file holds no percent sign, which pdsh would expand in the remote command (run_launch
passes pdsh's node rank placeholder as NODE, as DeepSpeed's runner does for launch.py).
"""

import base64
import json
import os
import signal
import sys
import time


def tagged_pids(launch_id: str) -> list[int]:
    """Pids of this node's processes started with NEOX_LAUNCH_ID=launch_id."""
    tag = b"\0NEOX_LAUNCH_ID=" + launch_id.encode() + b"\0"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = b"\0" + f.read() + b"\0"
        except OSError:
            continue  # gone, or not ours to read
        if tag in environ:
            pids.append(int(entry))
    return pids


def _alive(pid: int) -> bool:
    """Not gone and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def reap(launch_id: str, grace_s: float = 5.0) -> int:
    """SIGTERM the launch's processes, SIGKILL what is left after grace_s; returns how many.

    Each phase signals every process it finds at each look, not just those of the first: a
    parent signalled while it forks leaves a child that appears only afterwards. SIGKILL is
    waited on for at least 10 s, as a large process under load can take seconds to go."""
    seen = set()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, max(grace_s, 10.0))):
        signalled = set()
        deadline = time.monotonic() + wait_s
        while True:
            alive = [pid for pid in tagged_pids(launch_id) if _alive(pid)]
            if not alive or time.monotonic() > deadline:
                break
            seen.update(alive)
            for pid in alive:
                if pid in signalled and sig == signal.SIGTERM:
                    continue  # one stop request each; the SIGKILL phase follows
                signalled.add(pid)
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            time.sleep(0.1)
    return len(seen)


def _cmdline(pid) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


def _node_launcher(cmdline: list[bytes], node_rank: int):
    """For DeepSpeed's launch.py of this node rank: how many ranks it starts; else None."""
    # pdsh splits its own argv in place, so its command line holds the same words: the launcher
    # is the python process running the module.
    if b"python" not in os.path.basename(cmdline[0]):
        return None
    if b"deepspeed.launcher.launch" not in cmdline:
        return None
    if f"--node_rank={node_rank}".encode() not in cmdline:
        return None
    for arg in cmdline:
        if arg.startswith(b"--world_info="):
            world = json.loads(base64.urlsafe_b64decode(arg.split(b"=", 1)[1]))
            return len(list(world.values())[node_rank])
    return 0


def node_ranks(launch_id: str, node_rank: int):
    """(how many ranks this node's launch.py starts, or None while it is not running; the pids of
    those started): the children of DeepSpeed's launch.py for that node rank (two nodes may be
    one machine). Not launch.py itself, whose SIGTERM handler kills the ranks; not a rank's
    own workers."""
    expected, ranks = None, []
    for pid in tagged_pids(launch_id):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
            count = _node_launcher(_cmdline(pid), node_rank)
            if count is not None:
                expected = count
            elif _node_launcher(_cmdline(parent), node_rank) is not None:
                ranks.append(pid)
        except (OSError, IndexError, ValueError):
            continue
    return expected, ranks


def signal_ranks(
    launch_id: str, node_rank: int, sig: int = signal.SIGTERM, wait_s: float = 50.0
) -> int:
    """Send sig to the launch's ranks of one node; returns how many. Ranks not started yet (a
    stop asked for while the launch starts) are waited for, up to wait_s."""
    signalled = set()
    deadline = time.monotonic() + wait_s
    while True:
        expected, pids = node_ranks(launch_id, node_rank)
        for pid in set(pids) - signalled:
            signalled.add(pid)
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        started = expected is not None and len(signalled) >= expected
        if started or time.monotonic() > deadline:
            return len(signalled)
        time.sleep(0.1)


if __name__ == "__main__":
    if sys.argv[2:3] == ["ranks"]:
        print(f"signalled {signal_ranks(sys.argv[1], int(sys.argv[3]))} rank(s)")
    else:
        reap(sys.argv[1])
