"""train.py on gloo ranks: every parallel layout reproduces the single-rank run's losses.

The runs are the session's shared layout matrix (tests/layout_helpers.py), also read by the checkpoint
tests."""

import pytest

from tests.layout_helpers import LAYOUTS
from tests.train_helpers import losses

pytestmark = pytest.mark.slow


def test_parallel_layouts_match_one_rank(trained):
    result = {name: losses(trained.logs(name)) for name in LAYOUTS}
    assert sorted(result["dense"]) == [1, 2, 3, 4, 5]
    for name in LAYOUTS:
        for step, loss in result["dense"].items():
            # fp32; the reductions run in another order across ranks.
            assert result[name][step] == pytest.approx(loss, rel=1e-5), (name, step)
