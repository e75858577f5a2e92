"""One all-reduce per parallel-residual block under tensor parallelism (apply_tensor_parallel),
on 2 gloo ranks against the dense block and model."""

import pytest

from tests.parallel import parallel_residual_helpers as helpers
from tests.parallel.rank_helpers import run_ranks


def test_fused_block_matches_dense_and_reduces_once():
    """Output, input and parameter gradients equal the dense block's (hidden dropout, one norm
    or two, biases or none); the forward makes one all-reduce."""
    run_ranks(helpers.check_block_matches_dense, 2)


def test_sequential_moe_and_sequence_parallel_blocks_keep_their_collectives():
    run_ranks(helpers.check_other_blocks_reduce_per_layer, 2)


def test_parallelized_model_matches_dense_with_hidden_dropout():
    run_ranks(helpers.check_model_matches_dense, 2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fused_block_is_one_graph(backend):
    run_ranks(helpers.check_compiled_block, 2, backend)
