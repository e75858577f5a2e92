"""Two "nodes" on one 4-GPU host (`pytest -m multigpu`): deepy.py with a hostfile of two names
for this machine, `include` giving each 2 of the GPUs, and `launcher: pdsh` (an ssh session and
a neox agent per node, through the private sshd of tests/launcher/conftest.py) trains TP=2 x
DP=2 with the losses of the same run on one node."""

import pytest

from tests.port_helpers import free_port
from tests.train_helpers import SHORT_RUN, losses, make_dataset, run_deepy, write_config

pytestmark = [pytest.mark.multigpu, pytest.mark.slow]

# fp32 and the same reduction layout: only NCCL's choice of algorithm across the two agents'
# ranks differs, so the losses agree to rounding.
RUN = dict(SHORT_RUN, model_parallel_size=2, distributed_backend="nccl", zero_optimization={})


def test_two_nodes_of_two_gpus_match_one_node_of_four(sshd, tmp_path):
    make_dataset(tmp_path / "data" / "chars")
    one = write_config(tmp_path, "one", num_gpus=4, gradient_accumulation_steps=1, **RUN)
    run_deepy("train.py", one, cpu=False)

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=4\n127.0.0.1 slots=4\n")
    two = write_config(
        tmp_path,
        "two",
        num_gpus=None,
        gradient_accumulation_steps=1,
        hostfile=str(hostfile),
        include="localhost:0,1@127.0.0.1:2,3",
        launcher="pdsh",
        master_addr="127.0.0.1",
        master_port=free_port(),
        ssh_port=sshd.port,
        no_ssh_check=True,
        **RUN,
    )
    out = run_deepy("train.py", two, cpu=False, PDSH_SSH_ARGS_APPEND=sshd.ssh_args).stdout
    one, both = losses(tmp_path / "one" / "logs"), losses(tmp_path / "two" / "logs")
    assert sorted(both) == [1, 2, 3, 4, 5], out[-3000:]
    for step, loss in one.items():
        assert both[step] == pytest.approx(loss, rel=1e-4), (step, one, both)
