"""End every process on this node whose environment carries one launch's NEOX_LAUNCH_ID.

Standard library only: run_launch sends this file's source to each node as `python -c` over pdsh,
so it needs nothing installed there. Matching the unique id, not a command name, keeps other jobs
on a shared node alive (DeepSpeed's own cleanup is `pkill -f` on the launcher's name).
"""

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


def reap(launch_id: str, grace_s: float = 5.0) -> int:
    """SIGTERM the launch's processes, SIGKILL what is left after grace_s; returns how many."""
    pids = tagged_pids(launch_id)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tagged_pids(launch_id):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while tagged_pids(launch_id) and time.monotonic() < deadline:
            time.sleep(0.1)
    return len(pids)


if __name__ == "__main__":
    reap(sys.argv[1])
