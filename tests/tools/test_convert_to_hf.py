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
