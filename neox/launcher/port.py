"""A free TCP port for rank 0's rendezvous, so runs sharing a machine do not collide."""

import socket

# DeepSpeed's default: used when the ranks span several nodes and none was configured, since
# a port free here says nothing about the first host.
DEFAULT_MASTER_PORT = 29500


def free_port() -> int:
    """A port the kernel reports free now (another process could still take it before use)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
