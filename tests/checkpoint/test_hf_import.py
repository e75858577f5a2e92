"""convert_from_hf: a random transformers model -> neox checkpoint at any TP/PP -> HF again is
byte-exact, and a finetune run through deepy.py starts from exactly those weights."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from neox.checkpoint.consolidate import load_model
from neox.checkpoint.export import export_to_hf
from neox.checkpoint.hf_import import HFImportError, convert_from_hf
from neox.data.indexed import IndexedDatasetBuilder
from neox.model import lm_loss
from tests.train_helpers import ROOT, losses, train, write_config

SIZES = dict(
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
)


def random_hf_model(arch: str, tokenizer_json, out, **overrides):
    """A randomly initialised transformers model saved with the BPE tokenizer (no downloads)."""
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(0)
    if arch == "gpt_neox":
        config = GPTNeoXConfig(**SIZES, intermediate_size=64, rotary_pct=0.5, **overrides)
        model = GPTNeoXForCausalLM(config)
    else:
        config = LlamaConfig(**SIZES, intermediate_size=48, num_key_value_heads=2, **overrides)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token="<|endoftext|>")
    tok.save_pretrained(out)
    return model.eval()


CASES = {
    "neox_tp2": ("gpt_neox", dict(use_parallel_residual=True), 2, 1),
    "neox_tied_pp2": (
        "gpt_neox",
        dict(use_parallel_residual=False, tie_word_embeddings=True),
        1,
        2,
    ),
    "llama_gqa_tp2_pp2": ("llama", dict(), 2, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_hf_to_neox_to_hf_is_byte_exact(case, bpe_tokenizer, tmp_path):
    arch, overrides, tp, pp = CASES[case]
    hf = random_hf_model(arch, bpe_tokenizer, tmp_path / "hf", **overrides)
    config, note = convert_from_hf(tmp_path / "hf", tmp_path / "neox", tp=tp, pp=pp)
    assert note is None
    keys = yaml.safe_load(config.read_text())
    assert keys["model_parallel_size"] == tp and keys["finetune"] is True

    export_to_hf(
        tmp_path / "neox", tmp_path / "back", architecture={"llama": "llama"}.get(arch, "neox")
    )
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name

    # The neox model of the checkpoint and the exported HF model compute the HF model's logits.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, _ = load_model(tmp_path / "neox")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(exported) is type(hf)
    assert AutoTokenizer.from_pretrained(tmp_path / "back").eos_token == "<|endoftext|>"
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids)[..., :320], expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(exported(ids).logits, expected, rtol=0, atol=0)


def test_unsupported_hf_models_are_refused_before_writing(bpe_tokenizer, tmp_path):
    random_hf_model(
        "llama",
        bpe_tokenizer,
        tmp_path / "hf",
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
    )
    with pytest.raises(HFImportError, match="rope_type='longrope'"):
        convert_from_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "convert_from_hf.py"),
            "--input_dir",
            str(tmp_path),
            "--output_dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "has no config.json; pass a local Hugging Face model directory" in r.stderr


def write_constant_dataset(prefix, doc: list[int]) -> None:
    """Documents all equal and seq_length tokens long: every training sample is the same."""
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for _ in range(40):
        builder.add_item(np.array(doc, dtype=np.uint16))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


@pytest.mark.slow
def test_finetune_run_starts_from_the_converted_weights(bpe_tokenizer, tmp_path):
    hf = random_hf_model("gpt_neox", bpe_tokenizer, tmp_path / "hf")
    config, _ = convert_from_hf(tmp_path / "hf", tmp_path / "neox", tp=2)
    doc = torch.randint(1, 320, (31,), generator=torch.Generator().manual_seed(2)).tolist() + [0]
    (tmp_path / "data").mkdir()
    write_constant_dataset(tmp_path / "data" / "chars", doc)
    run = write_config(
        tmp_path,
        "finetune",
        train_iters=1,
        eval_interval=100,
        do_test=False,
        save=None,
        num_gpus=2,
        model_parallel_size=2,
        seq_length=32,
    )
    train(run, config)
    sample = torch.tensor([doc + doc[:1]])
    with torch.no_grad():
        expected = lm_loss(hf(sample[:, :-1]).logits, sample[:, 1:]).item()
    assert losses(tmp_path / "finetune" / "logs")[1] == pytest.approx(expected, rel=1e-5)
