"""The one place a launch meets a shell: the ssh command that starts a node's agent."""

import shlex
from collections.abc import Mapping
from typing import Optional

CONNECT_TIMEOUT_S = 10
# A node that dies without closing its connection (power, a kernel panic, a lost link) ends its
# ssh session within about a minute, as a failure deepy.py names (and max_restarts restarts),
# rather than after TCP's own timeout of many minutes.
KEEPALIVE = ("ServerAliveInterval=15", "ServerAliveCountMax=4")


def ssh_argv(host: str, port: Optional[int], env: Mapping[str, str]) -> list[str]:
    """`ssh ... -- host` with the options the launch uses (PDSH_SSH_ARGS_APPEND adds some); the
    host after `--`, so that no name is ever read as an option."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", "-x"]
    cmd += [arg for option in KEEPALIVE for arg in ("-o", option)]
    if port is not None:
        cmd += ["-p", str(port)]
    return cmd + shlex.split(env.get("PDSH_SSH_ARGS_APPEND", "")) + ["--", host]


def remote_command(cwd: str, exports: Mapping[str, str], argv: list[str]) -> str:
    """One shell line for a node: cd, export, then exec the agent so that it is the ssh
    session's own child (it dies with the session). Every value is quoted for that shell."""
    parts = [f"cd {shlex.quote(cwd)}"]
    parts += [f"export {name}={shlex.quote(value)}" for name, value in exports.items()]
    parts.append("exec " + shlex.join(argv))
    return " && ".join(parts)
