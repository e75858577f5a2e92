"""Topology validation (no torch.distributed) and its rank layout vs DeepSpeed's."""

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from neox.config.model import ModelConfig
from neox.parallel.topology import Topology


def test_world_must_factor():
    assert Topology.from_world(8, tp=2, pp=2) == Topology(tp=2, pp=2, dp=2)
    assert Topology.from_world(4, tp=1, pp=0).pp == 1  # gpt-neox's pipe_parallel_size=0
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by model_parallel_size=4"):
        Topology.from_world(6, tp=4)
    with pytest.raises(ValueError, match="tp=0"):
        Topology(tp=0)


@pytest.mark.parametrize(
    "fields, tp, pp, message",
    [
        (
            dict(num_attention_heads=12, hidden_size=96),
            8,
            1,
            "num_attention_heads=12 is not divisible by model_parallel_size=8 (configs/x.yml); "
            "use model_parallel_size 1, 2, 3, 4, 6 or 12",
        ),
        (
            dict(num_attention_heads=8, num_kv_heads=2),
            4,
            1,
            "num_kv_heads=2 is not divisible by model_parallel_size=4",
        ),
        (
            dict(num_attention_heads=4, intermediate_size=66),
            4,
            1,
            "the MLP width 66 (intermediate_size/expansion_factor) is not divisible by "
            "model_parallel_size=4",
        ),
        (
            dict(num_layers=2),
            1,
            4,
            "num_layers=2 is smaller than pipe_parallel_size=4 (configs/x.yml); every stage needs "
            "a block: use pipe_parallel_size <= 2",
        ),
    ],
)
def test_validation_names_key_value_and_fix(fields, tp, pp, message):
    cfg = ModelConfig(**fields)
    with pytest.raises(ValueError) as err:
        Topology.validate(
            cfg,
            world_size=tp * pp,
            model_parallel_size=tp,
            pipe_parallel_size=pp,
            source="configs/x.yml",
        )
    assert message in str(err.value)


def test_valid_layout_passes():
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_kv_heads=2)
    assert Topology.validate(cfg, 16, model_parallel_size=2, pipe_parallel_size=4) == Topology(
        2, 4, 2
    )


@pytest.mark.parametrize("tp, pp, dp", [(2, 2, 2), (1, 4, 2), (4, 1, 3), (2, 3, 1)])
def test_rank_layout_matches_deepspeed(tp, pp, dp):
    ours = Topology(tp=tp, pp=pp, dp=dp)
    theirs = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    for rank in range(ours.world_size):
        c = theirs.get_coord(rank)
        assert tuple(ours.coord(rank))[:3] == (c.pipe, c.data, c.model)
    assert ours.tensor_group_ranks() == theirs.get_axis_comm_lists("model")
    assert ours.data_group_ranks() == theirs.get_axis_comm_lists("data")
    assert ours.pipe_group_ranks() == theirs.get_axis_comm_lists("pipe")
    for d, ranks in enumerate(ours.model_group_ranks()):
        assert sorted(ranks) == sorted(theirs.get_axis_list("data", d))
