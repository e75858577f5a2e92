"""tools/convert_from_hf.py: gpt-neox's convert_hf_llama_to_neox.py flags, and exit status 2
with nothing written on a refusal."""

import pytest
import yaml

from tests.checkpoint.test_hf_import import random_hf_model
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
