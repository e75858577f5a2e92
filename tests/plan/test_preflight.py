"""neox/plan/preflight.py: what deepy.py checks on disk before launch, from headers and sizes."""

import pytest

from neox.config import ConfigError, load_config
from neox.plan.preflight import (
    check_data,
    check_script,
    check_tokenizer_files,
    checkpoint_problem,
    preflight,
)
from tests.train_helpers import make_dataset


def loaded(tmp_path, text: str):
    path = tmp_path / "run.yml"
    path.write_text(text)
    return load_config([path])


def test_a_short_bin_is_named_with_its_key_and_file(tmp_path):
    make_dataset(tmp_path / "chars")
    cfg = loaded(tmp_path, f"data_path: {tmp_path}/chars\n")
    check_data(cfg)  # intact: nothing to say
    bin_file = tmp_path / "chars.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:-10])
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    message = str(e.value)
    assert "run.yml: data_path=" in message and "chars.bin" in message, message


def test_missing_halves_of_a_dataset_are_named(tmp_path):
    make_dataset(tmp_path / "a")
    (tmp_path / "a.idx").unlink()
    cfg = loaded(tmp_path, f"train_data_paths: [{tmp_path}/a, {tmp_path}/b]\n")
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    message = str(e.value)
    assert f"{tmp_path}/a.idx not found" in message
    assert f"{tmp_path}/b.bin and {tmp_path}/b.idx not found" in message
    assert "tools/preprocess_data.py" in message


def test_missing_entry_script_and_tokenizer_files(tmp_path):
    with pytest.raises(ConfigError, match="entry script 'nope.py' does not exist"):
        check_script("nope.py")
    cfg = loaded(tmp_path, f"tokenizer_type: GPT2BPETokenizer\nvocab_file: {tmp_path}/v.json\n")
    with pytest.raises(ConfigError) as e:
        check_tokenizer_files(cfg)
    assert "vocab_file=" in str(e.value) and "does not exist" in str(e.value)
    assert "needs merge_file" in str(e.value)


def test_preflight_collects_every_problem_at_once(tmp_path):
    cfg = loaded(tmp_path, f"data_path: {tmp_path}/none\nvocab_file: {tmp_path}/v.json\n")
    _, problems = preflight(cfg, "train.py")
    text = "\n".join(problems)
    assert "none.bin and" in text and "v.json" in text, text


def test_checkpoint_problem_names_what_is_missing(tmp_path):
    assert checkpoint_problem(None).startswith("no trained weights")
    assert "holds no checkpoint (no `latest` file)" in checkpoint_problem(str(tmp_path))
    (tmp_path / "global_step3").mkdir()
    assert "(it has global_step3)" in checkpoint_problem(str(tmp_path), iteration=5)
    assert checkpoint_problem(str(tmp_path), iteration=3) is None
