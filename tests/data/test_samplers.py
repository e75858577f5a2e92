import itertools

import pytest

from neox.data.samplers import PretrainingSampler


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_ranks_partition_each_global_batch_without_overlap():
    total, mbs, dp = 1000, 3, 4
    per_rank = [take(PretrainingSampler(total, 0, mbs, r, dp), 10) for r in range(dp)]
    for step in range(10):
        global_batch = [i for r in range(dp) for i in per_rank[r][step]]
        assert global_batch == list(range(step * mbs * dp, (step + 1) * mbs * dp))
    everything = [i for r in per_rank for batch in r for i in batch]
    assert len(everything) == len(set(everything)) == 10 * mbs * dp


@pytest.mark.parametrize("dp", [1, 2])
def test_resuming_at_k_gives_the_tail_of_the_uninterrupted_stream(dp):
    total, mbs = 97, 2
    for rank in range(dp):
        full = take(PretrainingSampler(total, 0, mbs, rank, dp), 40)
        for steps_done in (0, 1, 7, 23):
            consumed = steps_done * mbs * dp
            resumed = take(PretrainingSampler(total, consumed, mbs, rank, dp), 40 - steps_done)
            assert resumed == full[steps_done:]


def test_stream_wraps_around_instead_of_stopping(caplog):
    sampler = PretrainingSampler(5, 0, 2, 0, 1)
    with caplog.at_level("WARNING"):
        batches = take(sampler, 6)
    assert batches == [[0, 1], [2, 3], [4, 0], [1, 2], [3, 4], [0, 1]]
    assert sum("wrapping around" in r.message for r in caplog.records) == 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="no samples"):
        PretrainingSampler(0, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="consumed_samples"):
        PretrainingSampler(10, -1, 1, 0, 1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        PretrainingSampler(10, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank=2"):
        PretrainingSampler(10, 0, 1, 2, 2)
