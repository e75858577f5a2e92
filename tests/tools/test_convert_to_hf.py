"""tools/convert_to_hf.py: refusals before anything is written."""

import pytest
import yaml

from tests.inference.test_loading import char_checkpoint
from tools.convert_to_hf import main


def test_config_file_with_another_tokenizer_is_refused_unless_allowed(tmp_path):
    """Fault: --config_file names a tokenizer the checkpoint was not trained with (the export
    paired the weights with other token ids). Promise: refused, naming both; the key lets it."""
    char_checkpoint(tmp_path)
    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")
    other = tmp_path / "other.yml"
    other.write_text(yaml.safe_dump({"tokenizer_type": "HFTokenizer", "vocab_file": str(vocab)}))
    argv = ["--input_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "hf")]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--config_file", str(other)])
    assert e.value.code == 2
    assert "was trained with another tokenizer than this config's" in str(e.value)
    assert "tokenizer_type CharLevelTokenizer (checkpoint) vs HFTokenizer" in str(e.value)
    assert not (tmp_path / "hf").exists()
    # allow_tokenizer_mismatch: the check lets it through to the export, which refuses this
    # (learned-position) model for its own reason.
    keys = {"tokenizer_type": "HFTokenizer", "vocab_file": str(vocab)}
    other.write_text(yaml.safe_dump({**keys, "allow_tokenizer_mismatch": True}))
    with pytest.raises(SystemExit) as e:
        main([*argv, "--config_file", str(other)])
    assert "another tokenizer" not in str(e.value) and "cannot be written as HF" in str(e.value)


@pytest.mark.parametrize("text", ["{num_layers: [1,", "[1, 2]"])
def test_a_malformed_config_file_is_one_line_exit_2(tmp_path, capsys, text):
    char_checkpoint(tmp_path)
    bad = tmp_path / "bad.yml"
    bad.write_text(text)
    argv = ["--input_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "hf")]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*argv, "--config_file", str(bad)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"convert_to_hf: error: {bad} is not") and err.count("\n") == 1, err
    assert "is not a readable neox config (not valid YAML: " in err or "(a YAML list, not" in err
    assert not (tmp_path / "hf").exists()


def test_a_refused_architecture_names_ones_that_fit_and_the_flag_takes_them():
    """A Llama-shaped model refused as GPTNeoX is pointed at --architecture values the flag
    accepts (never gpt_neox, HF's model_type, which it rejects)."""
    from neox.config import NeoXConfig
    from neox.hf.export import ARCHITECTURES
    from neox.hf.mapping import check_exportable
    from tools.convert_to_hf import parse_args

    llama = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    llama.update(max_position_embeddings=16, pos_emb="rotary", rotary_pct=1.0, norm="rmsnorm")
    llama.update(activation="swiglu", use_bias_in_attn_linear=False, use_bias_in_mlp=False)
    cfg = NeoXConfig.from_flat(llama)
    with pytest.raises(ValueError) as e:
        check_exportable(cfg.model, "gpt_neox")
    assert "or export with --architecture llama or mistral." in str(e.value)
    for name in ("llama", "mistral"):
        check_exportable(cfg.model, ARCHITECTURES[name])
        args = parse_args(["--input_dir", "a", "--output_dir", "b", "--architecture", name])
        assert args.architecture == name
    with pytest.raises(SystemExit):
        parse_args(["--input_dir", "a", "--output_dir", "b", "--architecture", "gpt_neox"])


def test_a_damaged_carried_config_is_one_line_exit_2(bpe_tokenizer, tmp_path, capsys):
    """The config.json an import carried (hf_files) no longer parses: refused in one line."""
    from tests.hf.test_hf_import import random_hf_model
    from tools.convert_from_hf import main as import_hf

    random_hf_model("llama", bpe_tokenizer, tmp_path / "hf")
    import_hf(["--input_dir", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "neox")])
    (tmp_path / "neox" / "hf" / "config.json").write_text("{")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["--input_dir", str(tmp_path / "neox"), "--output_dir", str(tmp_path / "back")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "hf/config.json (the imported model's, hf_files) is damaged" in err
    )
    assert not (tmp_path / "back").exists()
