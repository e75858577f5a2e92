"""Rank 0's rendezvous port: a free one when none is configured, and a configured one checked."""

import errno
import socket

from neox.launcher.hostfile import LaunchError

# DeepSpeed's default: used when the ranks span several nodes and none was configured, since
# a port free here says nothing about the first host.
DEFAULT_MASTER_PORT = 29500


def free_port() -> int:
    """A port the kernel reports free now (another process could still take it before use)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_master_port(plan) -> None:
    """On a one-node launch, bind master_port as rank 0's store will: a port in use would
    otherwise surface as every rank failing on "address already in use" after start-up."""
    if plan.multi_node:
        return  # rank 0 runs on another machine
    with socket.socket() as s:
        # As torch's TCPStore does: a port only in TIME_WAIT from an earlier run is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", plan.master_port))
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise LaunchError(
                f"master_port={plan.master_port} {why} on this machine; set master_port to a "
                f"free port (e.g. {free_port()}) or leave it unset to take a free one"
            ) from None
