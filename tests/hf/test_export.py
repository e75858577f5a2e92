"""convert_to_hf: checkpoints of every layout load in transformers with neox's logits and
greedy tokens; refusals happen before anything is written."""

import json

import pytest
import torch
import yaml
from safetensors import safe_open

from neox.checkpoint.consolidate import load_model
from neox.checkpoint.staging import OutputDirError
from neox.hf.export import ExportError, export_to_hf
from neox.tokenizer import HFTokenizer

pytestmark = pytest.mark.slow

TEXT = "Checkpoints are read back into one plain model"


def greedy(forward, ids: torch.Tensor, steps: int = 8) -> list[int]:
    for _ in range(steps):
        with torch.no_grad():
            next_id = forward(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat((ids, next_id), dim=1)
    return ids[0].tolist()


@pytest.mark.parametrize("layout", ["dense", "tp2", "pp2", "zero2"])
def test_transformers_loads_the_export_with_neox_logits(trained, bpe_tokenizer, layout, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert export_to_hf(trained[layout], out) is None
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ours, cfg = load_model(trained[layout])

    assert tok(TEXT)["input_ids"] == HFTokenizer(str(bpe_tokenizer)).encode(TEXT)
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


def test_cli_refuses_before_writing(trained, tmp_path):
    """convert_to_hf.main in process (the tool's own process: tests/test_demo.py's export)."""
    from tools.convert_to_hf import main

    with pytest.raises(SystemExit) as e:
        main(["--input_dir", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "out")])
    assert e.value.code != 0 and "does not exist; pass the directory a run saved to" in str(e.value)

    # A layernorm GPT-NeoX has no Llama form: every reason is listed, nothing is written.
    with pytest.raises(ExportError) as err:
        export_to_hf(trained["dense"], tmp_path / "out", architecture="llama")
    assert "norm='layernorm' (Llama needs rmsnorm)" in str(err.value)
    assert "rotary_pct=0.25" in str(err.value)
    assert not (tmp_path / "out").exists()

    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="exists and is not empty; pass --overwrite"):
        export_to_hf(trained["dense"], out)
    assert (out / "keep.txt").read_text() == "mine"

    main(["--input_dir", str(trained["dense"]), "--output_dir", str(out), "--overwrite"])
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name or ".old-" in p.name] == []


def test_gpt2_bpe_run_exports_gpt2_tokenizer_files(shared_data, tmp_path):
    """A GPT2BPETokenizer run (weights written directly, no training): AutoTokenizer encodes as
    neox's tokenizer does and the end-of-document token is eos."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from neox.checkpoint.writer import write_checkpoint
    from neox.config import load_dict
    from neox.model import build_model
    from neox.tokenizer import build_tokenizer

    vocab, merges = shared_data / "gpt2-vocab.json", shared_data / "gpt2-merges.txt"
    keys = dict(num_layers=1, hidden_size=16, num_attention_heads=2, pos_emb="rotary")
    cfg = load_dict(
        dict(keys, tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    )
    model = build_model(cfg.model, 50304, seed=5)
    write_checkpoint(model.state_dict(), cfg, tmp_path / "ckpt")
    assert export_to_hf(tmp_path / "ckpt", tmp_path / "hf") is None

    ours = build_tokenizer("GPT2BPETokenizer", str(vocab), str(merges))
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Hello world, it's a GPT-2 tokenizer.<|endoftext|> Again"
    assert tok(text)["input_ids"] == ours.encode(text)
    assert tok.eos_token_id == ours.eod == 50256
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([ours.encode(text)])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids)[..., :50257], rtol=0, atol=1e-5)


def test_reward_model_is_refused_before_writing(trained, tmp_path):
    saved = yaml.safe_load((trained["dense"] / "global_step3" / "config.yml").read_text())
    data = ("data_path", "train_data_paths", "valid_data_paths", "test_data_paths")
    saved = {k: v for k, v in saved.items() if k not in data}
    rm = dict(saved, train_impl="rm", pos_train_data_paths=["c"], neg_train_data_paths=["r"])
    rm_cfg = tmp_path / "rm.yml"
    rm_cfg.write_text(yaml.safe_dump(dict(rm, do_valid=False, do_test=False)))
    with pytest.raises(ExportError, match="reward model .* not implemented"):
        export_to_hf(trained["dense"], tmp_path / "hf", config_file=rm_cfg)
    assert not (tmp_path / "hf").exists()
