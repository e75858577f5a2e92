"""convert_to_hf: checkpoints of every layout load in transformers with neox's logits and
greedy tokens; refusals happen before anything is written."""

import json
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors import safe_open

from neox.checkpoint.consolidate import load_model
from neox.checkpoint.export import export_to_hf
from tests.train_helpers import ROOT

pytestmark = pytest.mark.slow

TEXT = "Checkpoints are read back into one plain model"


def greedy(forward, ids: torch.Tensor, steps: int = 8) -> list[int]:
    for _ in range(steps):
        with torch.no_grad():
            next_id = forward(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat((ids, next_id), dim=1)
    return ids[0].tolist()


@pytest.mark.parametrize("layout", ["dense", "tp2", "pp2", "zero2"])
def test_transformers_loads_the_export_with_neox_logits(trained, layout, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert export_to_hf(trained[layout], out) is None
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ours, cfg = load_model(trained[layout])

    ids = torch.tensor([tok(TEXT)["input_ids"]])
    assert ids.shape[1] > 5 and tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert hf.config.vocab_size == 320 and type(hf).__name__ == "GPTNeoXForCausalLM"
    with torch.no_grad():
        expected = ours(ids)[..., :320]  # padded rows are dropped on export
        got = hf(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert greedy(lambda x: hf(x).logits, ids) == greedy(lambda x: ours(x)[..., :320], ids)


def test_precision_and_tokenizer_that_cannot_be_exported(trained, tmp_path):
    # The same weights described with the char-level tokenizer: the model is still written.
    saved = yaml.safe_load((trained["dense"] / "global_step3" / "config.yml").read_text())
    char_cfg = tmp_path / "char.yml"
    char_cfg.write_text(yaml.safe_dump(dict(saved, tokenizer_type="CharLevelTokenizer")))
    out = tmp_path / "hf"
    note = export_to_hf(trained["dense"], out, config_file=char_cfg, precision="bf16")
    assert "CharLevelTokenizer is not exported" in note
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("embed_out.weight").dtype == torch.bfloat16


def convert(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_to_hf.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_cli_refuses_before_writing(trained, tmp_path):
    r = convert("--input_dir", tmp_path / "missing", "--output_dir", tmp_path / "out")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "does not exist; pass the directory a run saved to" in r.stderr

    # A layernorm GPT-NeoX has no Llama form: every reason is listed, nothing is written.
    r = convert(
        "--input_dir", trained["dense"], "--output_dir", tmp_path / "out", "--architecture", "llama"
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "norm='layernorm' (Llama needs rmsnorm)" in r.stderr and "rotary_pct=0.25" in r.stderr
    assert not (tmp_path / "out").exists()

    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = convert("--input_dir", trained["dense"], "--output_dir", out)
    assert r.returncode != 0 and "exists and is not empty; pass --overwrite" in r.stderr
    assert (out / "keep.txt").read_text() == "mine"

    r = convert("--input_dir", trained["dense"], "--output_dir", out, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name or ".old-" in p.name] == []
