"""The state by plain name: pieces written at one tensor-parallel split read back at another."""

import pytest
import torch

from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.plain_state import (
    Layout,
    PlainState,
    saved_layout,
    tp_piece,
    write_client_state,
    write_meta,
    write_pieces,
)
from neox.parallel.layers import shard


def save(step_dir, full: dict[str, tuple[torch.Tensor, object]], tp: int) -> None:
    """Each of tp ranks writes its slice of every split tensor; rank 0 the unsplit ones."""
    for rank in range(tp):
        pieces = []
        for name, (tensor, dim) in full.items():
            if dim is None and rank > 0:
                continue
            local = tensor if dim is None else shard(tensor, dim, rank, tp)
            pieces.append(tp_piece(name, {"fp32": local, "exp_avg": 2 * local}, dim, rank, tp))
        write_pieces(step_dir, rank, pieces)
        write_client_state(step_dir, rank, {"iteration": 3, "mp_rank": rank})
    write_meta(step_dir, Layout("deepspeed", tp, 1, 1, 1), {"step": 3.0})


def test_slices_written_at_tp4_read_at_tp2_and_whole(tmp_path):
    torch.manual_seed(0)
    rows, cols, bias = torch.randn(8, 6), torch.randn(6, 8), torch.randn(6)
    save(tmp_path, {"a.weight": (rows, 0), "b.weight": (cols, 1), "n.bias": (bias, None)}, tp=4)
    state = PlainState(tmp_path)
    assert state.scalars["step"] == 3.0 and state.client_state == {"iteration": 3, "mp_rank": 0}
    assert state.client_ranks == 4  # each model-parallel rank's own, as DeepSpeed kept them
    assert PlainState(tmp_path, mp_rank=3).client_state["mp_rank"] == 3
    assert saved_layout(tmp_path) == Layout("deepspeed", 4, 1, 1, 1)
    # Whole tensors (the flat engine), and the other split's slices, each spanning two pieces.
    assert torch.equal(state.read("fp32", "a.weight", (8, 6), None, 0), rows)
    assert torch.equal(state.read("exp_avg", "b.weight", (6, 8), None, 0), 2 * cols)
    for rank in range(2):
        got = state.read("fp32", "a.weight", (4, 6), 0, 4 * rank)
        assert torch.equal(got, shard(rows, 0, rank, 2))
        got = state.read("fp32", "b.weight", (6, 4), 1, 4 * rank)
        assert torch.equal(got, shard(cols, 1, rank, 2))
    assert torch.equal(state.read("fp32", "n.bias", (3,), 0, 3), bias[3:])


def test_rows_past_the_saved_vocabulary_are_zero_and_missing_names_refused(tmp_path):
    embed = torch.randn(4, 3)
    save(tmp_path, {"embed_in.weight": (embed, 0)}, tp=2)
    state = PlainState(tmp_path)
    got = state.read("fp32", "embed_in.weight", (6, 3), None, 0)  # padded further here
    assert torch.equal(got[:4], embed) and not got[4:].any()
    with pytest.raises(CheckpointError, match="holds no fp32/layers.0.weight"):
        state.read("fp32", "layers.0.weight", (2, 2), None, 0)


def test_a_checkpoint_without_plain_state_names_its_layout_as_the_way(tmp_path):
    with pytest.raises(CheckpointError, match="resumes only at the layout that saved it"):
        PlainState(tmp_path)
