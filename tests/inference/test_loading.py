"""generate.py's mistakes are one error before launch; a checkpoint that does not fit is named."""

import pytest
import torch
import yaml

from neox.checkpoint.manifest import write_manifest
from neox.config import ConfigError, load_dict
from neox.config.model import ModelConfig
from neox.inference.loading import build_generation_model
from neox.model import build_model
from tests.train_helpers import run_deepy


def test_deepy_refuses_missing_checkpoint_iteration_prompt_file_and_cached_alibi(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = tmp_path / "gen.yml"
    cfg.write_text(yaml.safe_dump({"tokenizer_type": "CharLevelTokenizer", "load": str(empty)}))
    r = run_deepy("generate.py", cfg, check=False)
    assert r.returncode == 2 and "holds no checkpoint" in r.stderr and "`save`" in r.stderr
    assert "Traceback" not in r.stderr

    (tmp_path / "ckpt" / "global_step3").mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("global_step3")
    cfg.write_text(
        yaml.safe_dump(
            {
                "tokenizer_type": "CharLevelTokenizer",
                "load": str(tmp_path / "ckpt"),
                "iteration": 5,
                "text_gen_type": "input-file",
                "sample_input_file": str(tmp_path / "nope.txt"),
                "pos_emb": "alibi",
            }
        )
    )
    r = run_deepy("generate.py", cfg, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no checkpoint for iteration=5 (it has global_step3)" in r.stderr
    assert "sample_input_file=" in r.stderr and "nope.txt' does not exist" in r.stderr
    assert "does not support pos_emb=alibi; set `recompute: true`" in r.stderr


def test_a_checkpoint_of_another_shape_is_named(tmp_path, one_rank_group):
    from neox.parallel.topology import ProcessGroups, Topology

    small = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    state = build_model(small, 128).state_dict()
    cfg = load_dict(
        {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "load": str(tmp_path)}
    )
    groups = ProcessGroups(Topology(1, 1, 1))
    with pytest.raises(ConfigError, match="does not fit this model config.*config.yml"):
        build_generation_model(cfg, 128, groups, torch.device("cpu"), torch.float32, state)


def test_one_tensor_parallel_rank_gets_no_gather_so_decode_can_use_cuda_graphs(
    tmp_path, one_rank_group
):
    """generate.py hands the Generator this gather; only None lets it replay decode steps as
    CUDA graphs (an identity function here kept generate.py off the graph path)."""
    from neox.inference.generator import Generator
    from neox.parallel.topology import ProcessGroups, Topology

    shape = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
    state = build_model(ModelConfig(**shape), 128).state_dict()
    cfg = load_dict({**shape, "load": str(tmp_path)})
    groups = ProcessGroups(Topology(1, 1, 1))
    model, gather = build_generation_model(
        cfg, 128, groups, torch.device("cpu"), torch.float32, state
    )
    assert gather is None
    gen = Generator(model, 100, 0, gather_logits=gather)
    out = gen.generate([[1, 2, 3]], 4)
    assert len(out) == 1 and gen.cuda_graphs is False  # CPU: the device is the only reason left


def char_checkpoint(tmp_path):
    """A checkpoint as train.py leaves it (small real torch files), trained char-level."""
    step = tmp_path / "ckpt" / "global_step2"
    step.mkdir(parents=True)
    torch.save({"w": torch.arange(10.0)}, step / "mp_rank_00_model_states.pt")
    from neox.config import write_config

    write_config(load_dict({"tokenizer_type": "CharLevelTokenizer"}), step / "config.yml")
    write_manifest(step, 2, None)
    (tmp_path / "ckpt" / "latest").write_text("global_step2")


@pytest.mark.parametrize("script", ["generate.py", "eval.py"])
def test_another_tokenizer_than_the_checkpoints_is_refused(script, tmp_path, capsys):
    """Fault: generate/eval with a tokenizer the checkpoint was not trained with (it printed
    garbage or a wrong perplexity, exit 0). Promise: refused before launch and in a one-process
    run, unless allow_tokenizer_mismatch; no tokenizer key at all takes the checkpoint's."""
    import importlib

    char_checkpoint(tmp_path)
    vocab = tmp_path / "vocab.json"
    vocab.write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}')
    cfg = tmp_path / "run.yml"
    keys = {"load": str(tmp_path / "ckpt"), "eval_input_file": str(vocab)}
    cfg.write_text(
        yaml.safe_dump({**keys, "tokenizer_type": "HFTokenizer", "vocab_file": str(vocab)})
    )
    message = "was trained with another tokenizer than this config's:\n  tokenizer_type"
    r = run_deepy(script, cfg, check=False)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "allow_tokenizer_mismatch: true" in r.stderr and "Traceback" not in r.stderr
    # The one-process run (no deepy.py) refuses it too, before any model is built.
    assert importlib.import_module(script.removesuffix(".py")).main([str(cfg)]) == 2
    assert message in capsys.readouterr().err
    # With the override the tokenizer check passes (dry run: nothing else to load).
    allow = tmp_path / "allow.yml"
    allow.write_text("allow_tokenizer_mismatch: true\n")
    r = run_deepy(script, cfg, allow, "--dry-run", check=False)
    assert "another tokenizer" not in r.stderr, r.stderr
    # No tokenizer key: the checkpoint's own tokenizer is used.
    cfg.write_text(yaml.safe_dump(keys))
    r = run_deepy(script, cfg, "--dry-run", check=False)
    assert r.returncode == 0 and "tokenizer: the checkpoint's own, CharLevelTokenizer" in r.stdout
    assert "tokenizer_type: CharLevelTokenizer" in r.stdout
