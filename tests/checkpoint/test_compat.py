"""neox/checkpoint/compat.py: what deepy.py refuses to resume (or generate, evaluate, export)
from, before any rank starts."""

import signal

import pytest
import torch

from neox.checkpoint.compat import check_resume, describe_stop, tokenizer_mismatch
from neox.checkpoint.find import WEIGHTS_ONLY
from neox.checkpoint.manifest import write_manifest
from neox.config import ConfigError, derive, load_dict, write_config
from neox.config.transport import read_saved_config
from neox.launcher.run import KILLED_EXIT, LaunchResult

MODEL = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "pos_emb": "rotary",
    "tokenizer_type": "HFTokenizer",
}


def save_step(root, step: int, vocab_text: str, **keys) -> None:
    """A checkpoint as train.py leaves it: small real torch files, config.yml, the tokenizer,
    the manifest."""
    d = root / "ckpt" / f"global_step{step}"
    (d / "tokenizer").mkdir(parents=True)
    torch.save({"w": torch.arange(10.0)}, d / "mp_rank_00_model_states.pt")
    vocab = root / "train_tokenizer.json"
    vocab.write_text(vocab_text)
    (d / "tokenizer" / vocab.name).write_text(vocab_text)
    cfg = load_dict({**MODEL, "vocab_file": str(vocab), **keys})
    write_config(cfg, d / "config.yml")
    write_manifest(d, step, None)
    (root / "ckpt" / "latest").write_text(f"global_step{step}")
    vocab.unlink()  # the training run's file is gone: the checkpoint's copy is what counts


def run_config(tmp_path, vocab_text: str = '{"v": 1}', **keys):
    vocab = tmp_path / "tokenizer.json"
    vocab.write_text(vocab_text)
    flat = {**MODEL, "vocab_file": str(vocab), "load": str(tmp_path / "ckpt"), **keys}
    return load_dict(flat)


def check(cfg):
    return check_resume(cfg, derive(cfg, 1, 50000))


def test_the_same_tokenizer_under_another_path_resumes(tmp_path):
    save_step(tmp_path, 3, '{"v": 1}')
    assert check(run_config(tmp_path, train_iters=10)).startswith("resuming from")


def test_another_tokenizer_of_the_same_size_is_refused_unless_allowed(tmp_path):
    save_step(tmp_path, 3, '{"v": 1}')
    cfg = run_config(tmp_path, '{"v": 2}', train_iters=10)
    with pytest.raises(ConfigError) as e:
        check(cfg)
    message = str(e.value)
    assert "was trained with another tokenizer than this config's" in message
    assert "vocab_file" in message and "8 bytes, sha256" in message
    assert "global_step3/tokenizer" in message and "allow_tokenizer_mismatch: true" in message
    allowed = run_config(tmp_path, '{"v": 2}', train_iters=10, allow_tokenizer_mismatch=True)
    assert check(allowed).startswith("resuming from")
    other_type = run_config(tmp_path, tokenizer_type="CharLevelTokenizer", train_iters=10)
    with pytest.raises(ConfigError, match=r"tokenizer_type HFTokenizer \(checkpoint\) vs Char"):
        check(other_type)


def test_another_rotary_base_is_refused_on_resume_but_not_on_finetune(tmp_path):
    save_step(tmp_path, 3, '{"v": 1}')
    cfg = run_config(tmp_path, rotary_emb_base=500000, train_iters=10)
    with pytest.raises(ConfigError, match=r"rotary_emb_base 10000 \(checkpoint\) vs 500000"):
        check(cfg)
    tune = run_config(tmp_path, rotary_emb_base=500000, train_iters=10, finetune=True)
    assert check(tune).startswith("finetuning from")


def test_train_iters_below_the_checkpoint_step_is_refused_naming_both(tmp_path):
    save_step(tmp_path, 30, '{"v": 1}')
    with pytest.raises(ConfigError) as e:
        check(run_config(tmp_path, train_iters=20))
    assert "train_iters=20 is below the step of the checkpoint it resumes, 30" in str(e.value)
    assert check(run_config(tmp_path, train_iters=30)).startswith("resuming from")
    # A finetune restarts at iteration 0: its train_iters counts from there.
    assert check(run_config(tmp_path, train_iters=20, finetune=True)).startswith("finetuning")


def test_weights_only_checkpoint_needs_finetune(tmp_path):
    save_step(tmp_path, 0, '{"v": 1}')
    (tmp_path / "ckpt" / "global_step0" / WEIGHTS_ONLY).write_text("weights only\n")
    write_manifest(tmp_path / "ckpt" / "global_step0", 0, None)
    with pytest.raises(ConfigError, match="holds weights only .* set `finetune: true`"):
        check(run_config(tmp_path))
    assert check(run_config(tmp_path, finetune=True)).startswith("finetuning from")


def test_tokenizer_mismatch_compares_names_when_a_file_is_missing(tmp_path):
    save_step(tmp_path, 3, '{"v": 1}')
    step_dir = tmp_path / "ckpt" / "global_step3"
    saved = read_saved_config(step_dir)
    named = load_dict({**MODEL, "vocab_file": str(tmp_path / "elsewhere" / "train_tokenizer.json")})
    assert tokenizer_mismatch(saved, step_dir, named) is None  # same name, file not here
    other = load_dict({**MODEL, "vocab_file": str(tmp_path / "elsewhere" / "other.json")})
    assert "vocab_file" in tokenizer_mismatch(saved, step_dir, other)


def test_a_finetune_run_relaunched_unchanged_is_refused(tmp_path):
    """The converse of weights only: finetune: true on the run's own finetune checkpoint (save =
    load) would restart at iteration 0 on the finetuned weights and overwrite its saves."""
    save_step(tmp_path, 20, '{"v": 1}', finetune=True)
    ckpt = str(tmp_path / "ckpt")
    again = run_config(tmp_path, finetune=True, save=ckpt, train_iters=50)
    with pytest.raises(ConfigError, match="this finetune run's own step 20 .* set finetune: false"):
        check(again)
    assert check(run_config(tmp_path, save=ckpt, train_iters=50)).startswith("resuming from")
    # Finetuning from it into another directory is a new finetune: fine.
    other = run_config(tmp_path, finetune=True, save=str(tmp_path / "next"), train_iters=50)
    assert check(other).startswith("finetuning from")


def test_a_file_the_tokenizer_type_does_not_read_is_not_compared(tmp_path):
    """A char-level run layered on a BPE config keeps a vocab_file it never reads."""
    save_step(tmp_path, 3, '{"v": 1}', tokenizer_type="CharLevelTokenizer")
    step_dir = tmp_path / "ckpt" / "global_step3"
    char = load_dict({**MODEL, "tokenizer_type": "CharLevelTokenizer"})
    assert tokenizer_mismatch(read_saved_config(step_dir), step_dir, char) is None


def test_describe_stop_claims_a_checkpoint_only_after_a_clean_stop(tmp_path):
    ckpt = tmp_path / "ckpt"
    saving = load_dict({"save": str(ckpt)})
    int_, term = signal.SIGINT, signal.SIGTERM
    killed = LaunchResult(KILLED_EXIT, int_, killed=True)
    # Killed before any checkpoint exists, then with one saved before the stop.
    assert describe_stop(saving, killed) == (
        "stopped by SIGINT; the ranks were killed before saving (exit status 137); "
        f"no checkpoint in {ckpt} to resume from"
    )
    (ckpt / "global_step2").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step2")
    assert describe_stop(saving, killed) == (
        "stopped by SIGINT; the ranks were killed before saving (exit status 137); "
        f"the run can resume from the last checkpoint, {ckpt / 'global_step2'}"
    )
    assert describe_stop(load_dict({}), LaunchResult(KILLED_EXIT, term, killed=True)) == (
        "stopped by SIGTERM; the ranks were killed before saving (exit status 137); "
        "no `save` directory is configured"
    )
    # A clean stop (0 for SIGTERM, 130 for Ctrl-C) saved what `latest` now names.
    for code, sig in ((0, term), (130, int_)):
        assert describe_stop(saving, LaunchResult(code, sig)) == (
            f"stopped by {sig.name}; checkpoint saved in {ckpt / 'global_step2'}"
        )
    assert describe_stop(load_dict({}), LaunchResult(0, term)) == (
        "stopped by SIGTERM; nothing saved (no `save` directory is configured)"
    )
    assert describe_stop(saving, LaunchResult(1, term)) == (
        "stopped by SIGTERM; the ranks did not exit cleanly (exit status 1)"
    )


def test_describe_stop_claims_only_a_save_made_after_the_signal(tmp_path):
    """Issue 33 (6): a stop during a run of non-finite steps saves nothing, yet deepy printed
    `checkpoint saved in <save>/None`, or named an older step as this stop's."""
    from neox.checkpoint.atomic import write_atomic
    from neox.checkpoint.compat import latest_state

    ckpt = tmp_path / "ckpt"
    saving = load_dict({"save": str(ckpt)})
    term = LaunchResult(0, signal.SIGTERM)
    ckpt.mkdir()
    assert describe_stop(saving, term, latest_state(str(ckpt))) == (
        "stopped by SIGTERM; no checkpoint was saved at this stop (the ranks' output above says "
        f"why); no checkpoint in {ckpt} to resume from"
    )
    (ckpt / "global_step4").mkdir()
    write_atomic(ckpt / "latest", "global_step4")  # saved during the run, before the signal
    at_stop = latest_state(str(ckpt))
    assert describe_stop(saving, term, at_stop) == (
        "stopped by SIGTERM; no checkpoint was saved at this stop (the ranks' output above says "
        f"why); the run can resume from the last checkpoint, {ckpt / 'global_step4'}, saved "
        "before it"
    )
    write_atomic(ckpt / "latest", "global_step4")  # the stop saved the same step again
    assert describe_stop(saving, term, at_stop) == (
        f"stopped by SIGTERM; checkpoint saved in {ckpt / 'global_step4'}"
    )
