"""HFWeights: the layout from the headers alone, the tensors on demand, and clear errors for a
directory that is incomplete or holds more than tensors."""

import json
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file

from neox.hf.weights import HFWeights, HFWeightsError


def sharded(tmp_path):
    a = {"x.weight": torch.randn(3, 4), "y.weight": torch.randn(2).to(torch.bfloat16)}
    b = {"z.bias": torch.arange(5, dtype=torch.float16)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {**dict.fromkeys(a, "model-00001-of-00002.safetensors")}
    weight_map.update(dict.fromkeys(b, "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return {**a, **b}


def test_layout_then_tensors_on_demand(tmp_path):
    tensors = sharded(tmp_path)
    weights = HFWeights(tmp_path)
    meta = weights.meta()
    assert {k: (v.shape, v.dtype, v.device.type) for k, v in meta.items()} == {
        k: (v.shape, v.dtype, "meta") for k, v in tensors.items()
    }
    got = weights.read(["z.bias", "x.weight"])
    assert sorted(got) == ["x.weight", "z.bias"]
    assert all(torch.equal(got[k], tensors[k]) for k in got)


def test_missing_shard_is_named(tmp_path):
    sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(HFWeightsError, match="model-00002-of-00002.safetensors listed in"):
        HFWeights(tmp_path)


@dataclass
class Payload:
    """Stands for any object a pickle can carry (and run code to rebuild)."""

    note: str


def test_pytorch_file_holding_more_than_tensors_is_refused(tmp_path):
    """The weights-only unpickler: a .bin file with an arbitrary object is not loaded."""
    torch.save({"w": torch.ones(2), "extra": Payload("x")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(HFWeightsError, match="cannot be read as plain tensors"):
        HFWeights(tmp_path)
    torch.save({"w": torch.ones(2), "step": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(HFWeightsError, match="is not a state dict"):
        HFWeights(tmp_path)


def test_no_weights_at_all(tmp_path):
    with pytest.raises(HFWeightsError, match="has no weights: expected model.safetensors"):
        HFWeights(tmp_path)
