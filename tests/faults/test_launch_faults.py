"""Launch faults over a real pdsh/ssh launch: hostile strings never reach a shell as code, and a
node that ssh cannot reach stops the launch before any rank starts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.conftest import sshd  # noqa: F401  (the module's sshd fixture)
from tests.port_helpers import free_port
from tests.process_helpers import child_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# Every shell metacharacter that could run code or split words, in one string; each command
# substitution would create a file named pwned* in the directory it runs in.
HOSTILE = "a b 'c' \"d\" ;e $(touch pwned1) `touch pwned2` & | > f"


def launch(sshd, tmp_path: Path, hosts: str, **keys) -> subprocess.CompletedProcess:  # noqa: F811
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hosts)
    flat = {
        "hostfile": str(hostfile),
        "launcher": "pdsh",
        "master_addr": "127.0.0.1",
        "master_port": free_port(),
        "ssh_port": sshd.port,
        "no_ssh_check": True,
        "tokenizer_type": "CharLevelTokenizer",
        "export_env": ["NEOX_HOSTILE"],
        **keys,
    }
    cfg = tmp_path / "launch.yml"
    cfg.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in flat.items()))
    env = child_env(PDSH_SSH_ARGS_APPEND=sshd.ssh_args, NEOX_HOSTILE=HOSTILE)
    return subprocess.run(
        [
            sys.executable,
            "deepy.py",
            "tests/deepy_probe_helpers.py",
            str(cfg),
            "--wandb_group",
            HOSTILE,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def markers(*folders: Path) -> list[Path]:
    return [p for folder in folders for p in folder.glob("pwned*")]


def test_hostile_paths_and_values_reach_ranks_as_text(sshd, tmp_path):  # noqa: F811
    """Fault: a log_dir path, an exported variable and a flag value full of shell syntax.
    Promise: every rank sees them byte for byte and no command in them ever runs."""
    log_dir = tmp_path / HOSTILE.replace("/", "_")
    log_dir.mkdir()
    r = launch(sshd, tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n", log_dir=str(log_dir))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(log_dir.glob("rank*.json"))]
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["hostile_env"] == HOSTILE and rank["wandb_group"] == HOSTILE
    assert markers(ROOT, tmp_path, log_dir, Path.home(), Path("/")) == []


def test_hostile_host_name_is_refused_before_ssh(sshd, tmp_path):  # noqa: F811
    """Fault: a hostfile host name with shell syntax. Promise: exit 2 naming it; nothing runs."""
    r = launch(sshd, tmp_path, "localhost;touch${IFS}pwned3 slots=1\n127.0.0.1 slots=1\n")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "has characters other than letters" in r.stderr and "Traceback" not in r.stderr
    assert markers(ROOT, tmp_path, Path.home(), Path("/")) == []


def test_unreachable_node_fails_before_any_rank_starts(sshd, tmp_path):  # noqa: F811
    """Fault: one node of the hostfile cannot be reached over ssh. Promise: exit 2 naming the
    node, before any rank starts (no rank output anywhere)."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    hosts = "127.0.0.1 slots=1\nno-such-node.invalid slots=1\n"
    r = launch(sshd, tmp_path, hosts, log_dir=str(log_dir))
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "cannot log into these nodes over ssh" in r.stderr
    assert "no-such-node.invalid" in r.stderr and "Traceback" not in r.stderr
    assert list(log_dir.glob("rank*.json")) == []
