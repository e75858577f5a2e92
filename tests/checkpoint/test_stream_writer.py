"""StreamingCheckpoint: files laid out first and filled tensor by tensor, in any order, load as
exactly the files writer.write_checkpoint writes from the whole state dict."""

import pytest
import torch

from neox.checkpoint.consolidate import load_model_state
from neox.checkpoint.stream_writer import StreamingCheckpoint
from neox.checkpoint.writer import write_checkpoint
from neox.config import load_dict
from neox.model import build_model

KEYS = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    pos_emb="rotary",
    norm="rmsnorm",
    activation="swiglu",
    no_weight_tying=True,
    tokenizer_type="CharLevelTokenizer",
    padded_vocab_size=64,
)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_streamed_files_load_as_the_written_ones(tp, pp, tmp_path):
    flat = dict(KEYS, model_parallel_size=tp, **({"pipe_parallel_size": pp} if pp > 1 else {}))
    cfg = load_dict(flat)
    sd = build_model(cfg.model, 64, seed=3).state_dict()
    sd = {k: v.to(torch.bfloat16) if "mlp" in k else v for k, v in sd.items()}  # mixed dtypes
    write_checkpoint(sd, cfg, tmp_path / "whole")

    writer = StreamingCheckpoint(
        cfg, tmp_path / "streamed", {k: v.to("meta") for k, v in sd.items()}
    )
    with pytest.raises(ValueError, match="the layout says"):
        writer.write("embed_in.weight", sd["embed_in.weight"][:8])
    for name in reversed(list(sd)):  # any order
        writer.write(name, sd[name])
    with pytest.raises(ValueError, match="written twice"):
        writer.write("embed_in.weight", sd["embed_in.weight"])
    writer.finish()

    whole = sorted(p.name for p in (tmp_path / "whole" / "global_step0").iterdir())
    assert sorted(p.name for p in (tmp_path / "streamed" / "global_step0").iterdir()) == whole
    for name in whole:
        if name.endswith(".pt"):
            a = torch.load(tmp_path / "whole" / "global_step0" / name, weights_only=True)
            b = torch.load(tmp_path / "streamed" / "global_step0" / name, weights_only=True)
            assert a.keys() == b.keys(), name
            module_a, module_b = a.get("module", a) or {}, b.get("module", b) or {}
            for key, tensor in module_a.items():
                assert module_b[key].dtype == tensor.dtype and torch.equal(module_b[key], tensor)
    _, back = load_model_state(tmp_path / "streamed")
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_a_tensor_never_written_is_refused(tmp_path):
    cfg = load_dict(KEYS)
    sd = build_model(cfg.model, 64, device="meta").state_dict()
    writer = StreamingCheckpoint(cfg, tmp_path, sd)
    with pytest.raises(ValueError, match="never written"):
        writer.finish()
    assert not (tmp_path / "latest").exists()
