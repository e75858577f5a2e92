"""neox/entry.py: what every rank does first and last, and how it reads a peer's end."""

import subprocess
import sys

import pytest

from tests.port_helpers import free_port
from tests.train_helpers import ROOT

# Rank 0 leaves after the first barrier, as a rank does after its one-line error; rank 1 is in
# the next collective, whose gloo error must be read as "another rank ended".
RANK = """
import sys
import torch.distributed as dist
from neox.entry import peer_ended
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
dist.barrier()
if rank == 0:
    sys.exit(0)
try:
    dist.barrier()
except RuntimeError as e:
    print("peer ended" if peer_ended(e) else f"not recognised: {e}")
"""


@pytest.mark.slow
def test_a_collective_whose_peer_ended_is_recognised():
    """Issue 33 (8): after a clean error on rank 0 (a full disk), rank 1 added a gloo traceback;
    train.py now names the peer's end in one line instead."""
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), port], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    out = [p.communicate(timeout=120)[0] for p in ranks]
    assert out[1].strip() == "peer ended", out[1]
    from neox.entry import peer_ended

    assert not peer_ended(RuntimeError("CUDA out of memory"))
