"""The state by plain name holds each tensor once, whatever the data-parallel size."""

import math

import pytest
from safetensors import safe_open

from neox.checkpoint.plain_state import PlainState

pytestmark = pytest.mark.slow


def test_flat_engine_state_holds_each_tensor_once(trained):
    """The zero2 layout runs neox's flat engine on 2 data-parallel ranks (fp32 on CPU): each
    rank wrote the part of every tensor its partition holds (fp32 master and Adam's two
    moments), together each element once, and no rank a DeepSpeed optimizer file."""
    tag_dir = trained["zero2"] / "global_step3"
    assert not list(tag_dir.glob("*.pt"))
    files = sorted((tag_dir / "state").glob("rank_*.safetensors"))
    assert [f.name for f in files] == ["rank_00000.safetensors", "rank_00001.safetensors"]
    kinds: dict[str, int] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                kind = key.partition("/")[0]
                kinds[kind] = kinds.get(kind, 0) + math.prod(f.get_slice(key).get_shape())
    assert set(kinds) == {"fp32", "exp_avg", "exp_avg_sq"}
    entries = PlainState(tag_dir).entries
    params = sum(math.prod(e[0][1]["shape"]) for k, e in entries.items() if k.startswith("fp32/"))
    assert kinds["fp32"] == kinds["exp_avg"] == kinds["exp_avg_sq"] == params
    # 12 bytes a parameter, and a small header per file.
    assert sum(f.stat().st_size for f in files) < 12 * params + 2 * 64 * 1024
