"""train_impl and its keys: gpt-neox's post-training configs dry-run; wrong combinations are
refused before launch, naming the fix."""

import sys

import pytest

from neox.config import ConfigError, derive, load_dict
from tests.test_deepy import ROOT

PAIRS = {
    "dataset_impl": "pairwise",
    "pos_train_data_paths": ["d/train_chosen_document"],
    "neg_train_data_paths": ["d/train_rejected_document"],
    "do_valid": False,
    "do_test": False,
}


@pytest.mark.parametrize("impl", ["sft", "dpo", "kto", "rm"])
def test_gpt_neox_post_training_configs_dry_run(impl, capsys, monkeypatch):
    """deepy.py --dry-run in process (tests/test_deepy.py runs deepy.py's own process)."""
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(ROOT)
    sys.modules.pop("deepy", None)
    import deepy

    config = ROOT / f"configs/post-training/llama3-8b-{impl}.yml"
    assert deepy.main(["train.py", str(config), "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"train_impl: {impl if impl != 'sft' else 'normal'}" in out
    assert "model_parallel_size: 4" in out


def test_dpo_keys_are_read():
    cfg = load_dict({"train_impl": "dpo", "dpo_beta": 0.01, "dpo_fp32": False, **PAIRS})
    p = cfg.preference
    assert (p.train_impl, p.dpo_beta, p.dpo_fp32) == ("dpo", 0.01, False)
    derive(cfg, 1)


@pytest.mark.parametrize(
    "flat,message",
    [
        ({"train_impl": "dpo"}, "set pos_train_data_paths and neg_train_data_paths"),
        (
            {**PAIRS, "train_impl": "dpo", "neg_train_data_paths": ["a", "b"]},
            "give one rejected dataset per chosen one",
        ),
        (
            {**PAIRS, "train_impl": "rm", "pos_train_label_data_paths": ["a", "b"]},
            "give one label file per dataset",
        ),
        ({**PAIRS, "train_impl": "normal"}, "set train_impl: dpo"),
        ({"kto_beta": 0.3}, "asks for KTO training but train_impl is 'normal'"),
        ({**PAIRS, "train_impl": "dpo", "kto_beta": 0.3}, "set train_impl: kto"),
        ({"dataset_impl": "pairwise"}, "set dataset_impl: gpt2"),
        ({**PAIRS, "train_impl": "dpo", "pipe_parallel_size": 2}, "use pipe_parallel_size 1"),
        ({"train_impl": "kto", "train_data_paths": ["a"]}, "train_reward_data_paths"),
        ({"train_impl": "reinforce"}, "train_impl"),
    ],
)
def test_wrong_combinations_are_refused_by_name(flat, message):
    with pytest.raises(ConfigError, match=message):
        load_dict(flat)


def test_run_rules_kto_batch_and_evaluated_pairs():
    kto = {
        "train_impl": "kto",
        "train_data_paths": ["a"],
        "train_reward_data_paths": ["a_reward"],
        "do_valid": False,
        "do_test": False,
        "train_micro_batch_size_per_gpu": 1,
    }
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu >= 2"):
        derive(load_dict(kto), 1)
    zero3 = {**PAIRS, "train_impl": "dpo", "zero_optimization": {"stage": 3}}
    with pytest.raises(ConfigError, match="use ZeRO stage 1 or 2"):
        derive(load_dict(zero3), 1)
    derive(load_dict({**zero3, "dpo_reference_free": True}), 1)
    evaluated = {**PAIRS, "train_impl": "dpo", "do_valid": True}
    with pytest.raises(ConfigError, match="add pos_/neg_valid_data_paths"):
        derive(load_dict(evaluated), 1)
