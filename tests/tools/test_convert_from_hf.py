"""tools/convert_from_hf.py: gpt-neox's convert_hf_llama_to_neox.py flags, exit status 2 with
one line and nothing written on a refusal or any malformed input, --verify against transformers,
and the import's source recorded for PEFT exports."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from tests.hf.test_hf_import import random_hf_model
from tools.convert_from_hf import main


def test_gpt_neox_flags_are_aliases(bpe_tokenizer, tmp_path):
    """gpt-neox's `--tp 2 --pp 0 --model DIR --model_path OUT` converts as --input_dir DIR
    --output_dir OUT --tp 2 --pp 1 would."""
    random_hf_model("llama", bpe_tokenizer, tmp_path / "hf", max_shard_size="20KB")
    out = tmp_path / "neox"
    main(["--tp", "2", "--pp", "0", "--model", str(tmp_path / "hf"), "--model_path", str(out)])
    keys = yaml.safe_load((out / "model.yml").read_text())
    assert keys["model_parallel_size"] == 2 and "pipe_parallel_size" not in keys
    assert sorted(p.name for p in (out / "global_step0").glob("*model_states.pt")) == [
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
    ]
    assert (out / "latest").read_text() == "global_step0"


def test_refusal_exits_2_and_writes_nothing(bpe_tokenizer, tmp_path):
    random_hf_model("llama", bpe_tokenizer, tmp_path / "hf")
    argv = ["--model", str(tmp_path / "hf"), "--model_path", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--tp", "3"])  # 4 heads, 2 kv heads: not divisible by 3
    assert e.value.code == 2
    assert not (tmp_path / "out").exists()


def test_tokenizer_neox_cannot_build_still_round_trips(bpe_tokenizer, tmp_path, capsys):
    """A tokenizer with no <|endoftext|> and no eos_token gives neox no end-of-document token,
    so it writes no tokenizer keys; the export still carries the imported tokenizer files and
    --verify compares on their ids."""
    from transformers import PreTrainedTokenizerFast

    from tools.convert_to_hf import main as export

    renamed = tmp_path / "tokenizer.json"
    renamed.write_text(bpe_tokenizer.read_text().replace("<|endoftext|>", "<|end_of_text|>"))
    random_hf_model("llama", bpe_tokenizer, tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).unlink()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(renamed))
    tok.save_pretrained(tmp_path / "hf")
    out = tmp_path / "neox"
    main(["--input_dir", str(tmp_path / "hf"), "--output_dir", str(out)])
    assert "no tokenizer keys written" in capsys.readouterr().out
    keys = yaml.safe_load((out / "model.yml").read_text())
    assert "vocab_file" not in keys and keys["hf_files"] == str((out / "hf").resolve())
    export(["--input_dir", str(out), "--output_dir", str(tmp_path / "back"), "--verify"])
    assert "greedy tokens identical" in capsys.readouterr().out
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()


def test_llama3_style_tokenizer_takes_its_eos_token_as_eod(bpe_tokenizer, tmp_path, capsys):
    """Llama 3's tokenizer has no <|endoftext|>; its tokenizer_config.json names
    <|end_of_text|> as eos_token, which becomes neox's end-of-document token, so the import
    writes tokenizer keys a finetuning run can use, and the export still verifies."""
    from transformers import PreTrainedTokenizerFast

    from neox.tokenizer import build_tokenizer
    from tools.convert_to_hf import main as export

    renamed = tmp_path / "tokenizer.json"
    renamed.write_text(bpe_tokenizer.read_text().replace("<|endoftext|>", "<|end_of_text|>"))
    random_hf_model("llama", bpe_tokenizer, tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).unlink()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(renamed), eos_token="<|end_of_text|>")
    tok.save_pretrained(tmp_path / "hf")
    out = tmp_path / "neox"
    main(["--input_dir", str(tmp_path / "hf"), "--output_dir", str(out)])
    assert "no tokenizer keys written" not in capsys.readouterr().out
    keys = yaml.safe_load((out / "model.yml").read_text())
    assert keys["tokenizer_type"] == "HFTokenizer"
    ours = build_tokenizer("HFTokenizer", keys["vocab_file"])
    assert ours.eod == tok.convert_tokens_to_ids("<|end_of_text|>") == tok.eos_token_id
    assert ours.encode("hello world") == tok.encode("hello world")
    export(["--input_dir", str(out), "--output_dir", str(tmp_path / "back"), "--verify"])
    assert "greedy tokens identical" in capsys.readouterr().out


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory, bpe_tokenizer) -> Path:
    """A random Llama saved in one safetensors file (one/), in shards (shards/) and as a
    PyTorch file (bin/)."""
    root = tmp_path_factory.mktemp("hf_models")
    random_hf_model("llama", bpe_tokenizer, root / "one")
    random_hf_model("llama", bpe_tokenizer, root / "shards", max_shard_size="20KB")
    random_hf_model("llama", bpe_tokenizer, root / "bin", safe_serialization=False)
    return root


def _edit_config(d: Path, **fields) -> None:
    config = json.loads((d / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            del config[k]
        else:
            config[k] = v
    (d / "config.json").write_text(json.dumps(config))


def _truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def _retype(d: Path, name: str, dtype: torch.dtype) -> None:
    sd = load_file(d / "model.safetensors")
    sd[name] = sd[name].to(dtype)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def _move_in_index(d: Path) -> None:
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = next(iter(data["weight_map"]))
    others = [s.name for s in _shards(d) if s.name != data["weight_map"][name]]
    data["weight_map"][name] = others[0]
    index.write_text(json.dumps(data))


UP = "model.layers.0.mlp.up_proj.weight"
# name: (source model, how it is broken, what the one-line error says)
BAD_INPUTS = {
    "truncated safetensors": ("one", lambda d: _truncate(d / "model.safetensors"), "truncated"),
    "safetensors header cut": (
        "one",
        lambda d: _truncate(d / "model.safetensors", 20),
        "is not a readable safetensors file",
    ),
    "corrupt safetensors": (
        "one",
        lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),
        "is not a readable safetensors file",
    ),
    "truncated shard": ("shards", lambda d: _truncate(_shards(d)[1]), "truncated or corrupt"),
    "truncated pytorch file": (
        "bin",
        lambda d: _truncate(d / "pytorch_model.bin"),
        "cannot be read as plain tensors",
    ),
    "config.json not JSON": (
        "one",
        lambda d: (d / "config.json").write_text('{"model_type": "llama",'),
        "config.json is not valid JSON",
    ),
    "config.json a list": (
        "one",
        lambda d: (d / "config.json").write_text("[]"),
        "holds a JSON list, not an object",
    ),
    "config.json lacks a size": (
        "one",
        lambda d: _edit_config(d, hidden_size=None),
        "sizes must be positive integers: hidden_size missing",
    ),
    "config.json size as text": (
        "one",
        lambda d: _edit_config(d, num_attention_heads="4"),
        "num_attention_heads='4'",
    ),
    "tokenizer_config.json not JSON": (
        "one",
        lambda d: (d / "tokenizer_config.json").write_text("{"),
        "tokenizer_config.json is not valid JSON",
    ),
    "index not JSON": (
        "shards",
        lambda d: (d / "model.safetensors.index.json").write_text("{"),
        "is not a weight index",
    ),
    "shard missing": (
        "shards",
        lambda d: _shards(d)[1].unlink(),
        "listed in model.safetensors.index.json but missing",
    ),
    "index names the wrong shard": (
        "shards",
        _move_in_index,
        "weight index does not match its shards",
    ),
    "integer weights": ("one", lambda d: _retype(d, UP, torch.int32), "not floating point"),
    "mixed dtypes": ("one", lambda d: _retype(d, UP, torch.float16), "weights mix dtypes"),
    "shapes unlike config.json": (
        "one",
        lambda d: _edit_config(d, intermediate_size=64),
        "wrong shapes ['layers.0.mlp.dense_4h_to_h.weight (32, 48) != (32, 64)'",
    ),
    "vocab rows unlike config.json": (
        "one",
        lambda d: _edit_config(d, vocab_size=400),
        "has 320 rows but config.json's vocab_size is 400",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_malformed_input_is_one_line_exit_2_and_nothing_written(hf_models, tmp_path, capsys, case):
    source, spoil, says = BAD_INPUTS[case]
    hf = tmp_path / "hf"
    shutil.copytree(hf_models / source, hf)
    spoil(hf)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["--input_dir", str(hf), "--output_dir", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_from_hf: error: ") and err.count("\n") == 1, err
    assert says in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", ["auto", "bf16"])
def test_verify_compares_the_import_with_transformers(hf_models, tmp_path, capsys, dtype):
    from neox.hf.verify import VerifyError, verify_export

    out = tmp_path / "neox"
    argv = ["--input_dir", str(hf_models / "one"), "--output_dir", str(out), "--dtype", dtype]
    main([*argv, "--verify"])
    said = capsys.readouterr().out
    assert "transformers agrees with neox" in said and "8 greedy tokens identical" in said
    # The check would catch an import that changed a weight.
    other = tmp_path / "other"
    shutil.copytree(hf_models / "one", other)
    sd = load_file(other / "model.safetensors")
    sd["model.norm.weight"] = sd["model.norm.weight"] * 1.5
    save_file(sd, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VerifyError, match="logits differ"):
        verify_export(other, out)


def test_the_import_records_its_source(hf_models, tmp_path):
    from neox.hf.importer import hf_source

    main(["--input_dir", str(hf_models / "one"), "--output_dir", str(tmp_path / "neox")])
    keys = yaml.safe_load((tmp_path / "neox" / "model.yml").read_text())
    assert keys["hf_source"] == str((hf_models / "one").resolve())
    # A Hugging Face cache snapshot is recorded by its hub name.
    snapshot = tmp_path / "hub" / "models--EleutherAI--pythia-14m" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert hf_source(snapshot) == "EleutherAI/pythia-14m"
