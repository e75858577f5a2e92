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
