"""HF family models converted to neox compute transformers' logits at tp=2 and pp=2 (real gloo
ranks): RoPE scalings, sliding windows, QK-norm with its tp-summed gradients, q/k/v-only
biases, head_dim and tied/untied heads survive the split."""

import pytest

from tests.parallel.hf_family_layout_helpers import run
from tests.parallel.rank_helpers import run_ranks


@pytest.mark.slow
def test_families_at_tp2_and_pp2_match_transformers():
    run_ranks(run, 2, ["qwen3_qknorm_head_dim_yarn", "qwen2_window_yarn_tied", "llama3_gqa"])
