"""Ports for the tests' rendezvous stores, sshd and slurm daemons.

Each pytest-xdist worker draws from its own block below the kernel's ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768 and up by default), walking it from a random
start: two workers never pick the same port, and no outgoing connection of a concurrent test
(gloo opens many, on ephemeral ports) can take a port between the pick and the daemon's bind."""

import itertools
import os
import random
import socket

BLOCK = 1500
FIRST = 20000  # blocks 20000-32000: room for 8 workers below the ephemeral range


def _block_start() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # unset without xdist
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return FIRST + (index % 8) * BLOCK


_picks = itertools.count(random.SystemRandom().randrange(BLOCK))  # not the seeded global one


def free_port() -> int:
    """A TCP port of this worker's block that nothing is bound to right now."""
    start = _block_start()
    for _ in range(BLOCK):
        port = start + next(_picks) % BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}-{start + BLOCK - 1}")
