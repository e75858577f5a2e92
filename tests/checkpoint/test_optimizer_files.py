"""Each data-parallel rank's optimizer file holds its partition only, not the whole model."""

import pytest
import torch

from neox.checkpoint.trust import load_file

pytestmark = pytest.mark.slow


def test_flat_engine_optimizer_files_hold_one_partition(trained):
    """The zero2 layout runs neox's flat engine on 2 data-parallel ranks (fp32 on CPU)."""
    tag_dir = trained["zero2"] / "global_step3"
    model = load_file(tag_dir / "mp_rank_00_model_states.pt")["module"]
    params = sum(t.numel() for t in model.values())
    for rank in range(2):
        path = tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        optim = load_file(path)["optimizer_state_dict"]
        parts = optim["single_partition_of_fp32_groups"]
        assert optim["partition_count"] == [2] * len(parts)
        assert sum(p.numel() for p in parts) <= params // 2 + 2 * len(parts)
        for part in parts:  # not a view of the whole flat buffer
            assert torch.is_tensor(part) and part.untyped_storage().nbytes() == part.numel() * 4
        # fp32 master + two Adam moments of the partition, and a few KB of pickle.
        assert path.stat().st_size < 3 * 4 * (params // 2 + 2 * len(parts)) + 64 * 1024, path
