"""A private sshd on 127.0.0.1 for multi-node launch tests: own host key, user key and config."""

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.port_helpers import free_port

SSHD = "/usr/sbin/sshd"


@dataclass
class Sshd:
    """A running sshd and the ssh options that log into it without a password."""

    port: int
    user_key: Path
    process: subprocess.Popen

    @property
    def ssh_args(self) -> str:
        """Options for PDSH_SSH_ARGS_APPEND (the launch adds -p itself)."""
        return (
            f"-i {self.user_key} -o IdentitiesOnly=yes -o StrictHostKeyChecking=no "
            "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o BatchMode=yes"
        )

    def stop(self) -> None:
        """Stop this sshd (by its pid) and wait for it."""
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def missing_tools() -> list[str]:
    """Names of the programs a multi-node (ssh) launch test needs that this machine lacks."""
    needed = {"ssh": shutil.which("ssh")}
    needed["ssh-keygen"] = shutil.which("ssh-keygen")
    needed[SSHD] = SSHD if Path(SSHD).is_file() else None
    return [name for name, path in needed.items() if path is None]


def start_sshd(folder: Path) -> Sshd:
    """Generate keys in `folder`, start sshd on a free 127.0.0.1 port, wait until it answers."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True
        )
    (folder / "authorized_keys").write_text((folder / "user_key.pub").read_text())
    port = free_port()
    config = folder / "sshd_config"
    config.write_text(
        f"Port {port}\n"
        "ListenAddress 127.0.0.1\n"
        f"HostKey {folder / 'host_key'}\n"
        f"PidFile {folder / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\n"
        "PermitRootLogin yes\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "StrictModes no\n"
        "UsePAM no\n"
        # deepy.py opens one connection per node at once; keep the default limits out of the way.
        "MaxStartups 100\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory sshd insists on
    process = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "sshd.log", "wb"),  # noqa: SIM115 (sshd holds it for its lifetime)
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited: {(folder / 'sshd.log').read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return Sshd(port, folder / "user_key", process)
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"sshd did not listen on 127.0.0.1:{port} within 15 s")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """A private sshd on 127.0.0.1 that the test's user key logs into; stopped afterwards."""
    missing = missing_tools()
    if missing:
        pytest.skip(f"multi-node launch needs {', '.join(missing)}, not installed here")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        server.stop()
