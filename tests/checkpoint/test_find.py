"""Which checkpoint a load directory resumes from, and the config comparison before launch."""

import dataclasses
import json

import pytest
import torch

from neox.checkpoint.compat import architecture_differences, check_resume
from neox.checkpoint.find import checkpoint_problem, find_checkpoint
from neox.config import ConfigError, Derived, derive, load_dict, write_config


def save_step(root, step: int, with_manifest: bool = True) -> None:
    """A checkpoint directory as neox writes it, with small real torch files; without the
    manifest, as another tool (gpt-neox, DeepSpeed) writes it: no config.yml either."""
    d = root / f"global_step{step}"
    d.mkdir(parents=True)
    torch.save({"w": torch.arange(100.0)}, d / "mp_rank_00_model_states.pt")
    torch.save({"m": torch.ones(50)}, d / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    if with_manifest:
        write_config(load_dict({"hidden_size": 64, "num_attention_heads": 4}), d / "config.yml")
        files = {p.name: p.stat().st_size for p in d.iterdir()}
        (d / "manifest.json").write_text(json.dumps({"padded_vocab_size": 50304, "files": files}))
    (root / "latest").write_text(f"global_step{step}")


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])


def test_latest_is_used_when_complete(tmp_path):
    save_step(tmp_path, 3)
    save_step(tmp_path, 6)
    (tmp_path / "global_step9.partial").mkdir()  # a save that never finished
    r = find_checkpoint(str(tmp_path))
    assert (r.tag, r.skipped) == ("global_step6", [])


@pytest.mark.parametrize("manifest", [True, False])
def test_truncated_shard_falls_back_to_the_previous_checkpoint(tmp_path, manifest):
    save_step(tmp_path, 3, manifest)
    save_step(tmp_path, 6, manifest)
    shard = tmp_path / "global_step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    truncate(shard)
    r = find_checkpoint(str(tmp_path))
    assert r.tag == "global_step3"
    [(tag, reason)] = r.skipped
    assert tag == "global_step6" and str(shard) in reason and "truncated" in reason


def test_missing_shard_is_named(tmp_path):
    save_step(tmp_path, 3)
    (tmp_path / "global_step3" / "mp_rank_00_model_states.pt").unlink()
    problem = checkpoint_problem(tmp_path / "global_step3")
    assert problem.endswith("mp_rank_00_model_states.pt is missing")


def test_latest_naming_a_missing_directory_uses_the_newest_complete(tmp_path):
    save_step(tmp_path, 3)
    save_step(tmp_path, 6)
    (tmp_path / "latest").write_text("global_step9")
    r = find_checkpoint(str(tmp_path))
    assert r.tag == "global_step6" and r.skipped[0][0] == "global_step9"


def derived(padded: int) -> Derived:
    return dataclasses.replace(derive(load_dict({}), 1), padded_vocab_size=padded)


def test_every_architecture_difference_is_listed():
    saved = load_dict({"hidden_size": 64, "num_attention_heads": 4, "norm": "layernorm"})
    cfg = load_dict({"hidden_size": 128, "num_attention_heads": 4, "norm": "rmsnorm"})
    diffs = architecture_differences(saved, cfg, 50304, 50432)
    assert diffs == [
        "hidden_size 64 (checkpoint) vs 128 (config)",
        "norm layernorm (checkpoint) vs rmsnorm (config)",
        "padded vocab 50304 (checkpoint) vs 50432 (config)",
    ]
    assert architecture_differences(saved, saved, 50304, 50304) == []


def test_check_resume_refuses_a_mismatch_and_a_directory_of_broken_checkpoints(tmp_path):
    save_step(tmp_path, 3)
    cfg = load_dict({"hidden_size": 128, "num_attention_heads": 4, "load": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"(?s)hidden_size 64 \(checkpoint\) vs 128.*config.yml"):
        check_resume(cfg, derived(50304))
    same = load_dict({"hidden_size": 64, "num_attention_heads": 4, "load": str(tmp_path)})
    assert check_resume(same, derived(50304)).startswith("resuming from")
    truncate(tmp_path / "global_step3" / "mp_rank_00_model_states.pt")
    with pytest.raises(ConfigError, match="no checkpoint in load=.* can be loaded"):
        check_resume(same, derived(50304))


def test_finished_save_holds_config_tokenizer_and_manifest_and_replaces_a_resave(tmp_path):
    from neox.checkpoint.io import finish_save

    vocab = tmp_path / "tokenizer.json"
    vocab.write_text('{"model": {}}')
    cfg = load_dict(
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "tokenizer_type": "HFTokenizer",
            "vocab_file": str(vocab),
        }
    )
    final = tmp_path / "ckpt" / "global_step6"
    for attempt in range(2):  # the second save of the same step replaces the first
        staging = tmp_path / "ckpt" / "global_step6.partial"
        staging.mkdir(parents=True)
        torch.save({"w": torch.full((10,), float(attempt))}, staging / "mp_rank_00_model_states.pt")
        finish_save(cfg, staging, final, 6, 512)
        assert not staging.exists()
    assert torch.load(final / "mp_rank_00_model_states.pt")["w"][0] == 1.0
    assert (final / "tokenizer" / "tokenizer.json").read_text() == vocab.read_text()
    manifest = json.loads((final / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "config.yml",
        "mp_rank_00_model_states.pt",
        "tokenizer/tokenizer.json",
    }
    assert checkpoint_problem(final) is None
    assert not (tmp_path / "ckpt" / "global_step6.old").exists()
