"""The state by plain name holds each tensor once, whatever the data-parallel size."""

import math

import pytest
from safetensors import safe_open

pytestmark = pytest.mark.slow


def test_flat_engine_state_holds_each_tensor_once(trained):
    """The zero2 layout runs neox's flat engine on 2 data-parallel ranks (fp32 on CPU): rank 0
    gathered every partition and wrote each parameter whole, its fp32 master and Adam's two
    moments; rank 1 wrote no tensors, and no rank a DeepSpeed optimizer file."""
    tag_dir = trained["zero2"] / "global_step3"
    assert not list(tag_dir.glob("*.pt"))
    files = sorted((tag_dir / "state").glob("rank_*.safetensors"))
    assert [f.name for f in files] == ["rank_00000.safetensors"]
    with safe_open(str(files[0]), framework="pt") as f:
        numel = {k: f.get_slice(k).get_shape() for k in f.keys()}
    kinds = {}
    for key, shape in numel.items():
        kind, _, name = key.partition("/")
        kinds.setdefault(kind, {})[name] = shape
    assert set(kinds) == {"fp32", "exp_avg", "exp_avg_sq"}
    assert kinds["fp32"] == kinds["exp_avg"] == kinds["exp_avg_sq"]
    params = sum(math.prod(s) for s in kinds["fp32"].values())
    # 12 bytes a parameter, and a small header.
    assert files[0].stat().st_size < 12 * params + 64 * 1024
