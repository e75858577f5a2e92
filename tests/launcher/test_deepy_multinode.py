"""deepy.py with a hostfile and the pdsh launcher: two "nodes" of this machine over a real sshd."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_deepy_launches_over_pdsh_on_two_nodes(sshd, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two names for this machine\nlocalhost slots=1\n\n127.0.0.1 slots=2\n")
    cfg = tmp_path / "multinode.yml"
    cfg.write_text(
        "\n".join(
            f"{k}: {json.dumps(v)}"
            for k, v in {
                "hostfile": str(hostfile),
                "launcher": "pdsh",
                "master_addr": "127.0.0.1",
                "master_port": free_port(),
                "ssh_port": sshd.port,
                "no_ssh_check": True,
                "tokenizer_type": "CharLevelTokenizer",
                "hidden_size": 48,
                "log_dir": str(tmp_path),
            }.items()
        )
    )
    env = dict(os.environ, PDSH_SSH_ARGS_APPEND=sshd.ssh_args, PYTHONPATH=str(ROOT))
    env.pop("DS_ACCELERATOR", None)  # the ranks must learn it from the environment deepy exports
    r = subprocess.run(
        [sys.executable, "deepy.py", "tests/deepy_probe.py", str(cfg)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = {}
    for path in tmp_path.glob("rank*.json"):
        result = json.loads(path.read_text())
        ranks[result["rank"]] = result
    assert sorted(ranks) == [0, 1, 2]
    assert [ranks[i]["node_rank"] for i in range(3)] == [0, 1, 1]
    for result in ranks.values():
        assert result["world_size"] == 3
        assert result["sum"] == 1.0 + 2.0 + 3.0
        assert result["hidden_size"] == 48
        assert result["ds_accelerator"] == "cpu"
