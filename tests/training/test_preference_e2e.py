"""DPO through train.py on 2 CPU ranks (data parallel), with neox's flat engine and with
DeepSpeed's ZeRO-1: the step-1 loss is log 2, the reward metrics reach metrics.jsonl, and a run
resumed from its checkpoint trains against the saved reference, not the resumed weights."""

import math
import shutil

import pytest

from tests.preference_helpers import pair_keys, rewarded_keys
from tests.train_helpers import losses, records, train, write_config

pytestmark = pytest.mark.slow

WATCHED = {"chosen_rewards", "rejected_rewards", "reward_acc", "margins"}


def dpo_config(tmp_path, name, **overrides):
    keys = pair_keys(tmp_path / "pairs")
    overrides = {"train_impl": "dpo", **overrides}
    if overrides["train_impl"] == "dpo":
        overrides["dpo_beta"] = 0.5
    return write_config(
        tmp_path,
        name,
        data_path=None,
        dataset_impl="pairwise",
        pack_impl="unpacked",
        seq_length=16,
        max_position_embeddings=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **keys,
        **overrides,
    )


def test_dpo_trains_logs_its_metrics_and_resumes_against_the_saved_reference(tmp_path):
    train(dpo_config(tmp_path, "full"))
    logs = tmp_path / "full" / "logs"
    full = losses(logs)
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert full[1] == pytest.approx(math.log(2), abs=1e-4)  # policy = reference
    assert full[6] < full[1]
    for split in ("train", "valid"):
        logged = [r for r in records(logs) if r["split"] == split]
        assert logged and all(WATCHED <= r.keys() for r in logged), logged[0]

    # Stopped at step 3, resumed: steps 4-6 equal the uninterrupted run's only if the
    # reference is the starting weights saved in the checkpoint.
    train(dpo_config(tmp_path, "part", exit_interval=3))
    shutil.rmtree(tmp_path / "part" / "logs")
    train(dpo_config(tmp_path, "part"))
    part = losses(tmp_path / "part" / "logs")
    assert sorted(part) == [4, 5, 6]
    for step in (4, 5, 6):
        assert part[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step


def test_dpo_on_deepspeeds_engine_matches_the_flat_engine(tmp_path):
    short = dict(train_iters=3, checkpoint_factor=None, save=None, load=None, do_test=False)
    train(dpo_config(tmp_path, "flat", **short))
    train(dpo_config(tmp_path, "ds", flat_engine=False, **short))
    flat, ds = losses(tmp_path / "flat" / "logs"), losses(tmp_path / "ds" / "logs")
    assert ds[1] == pytest.approx(math.log(2), abs=1e-4)
    for step in (1, 2, 3):
        assert ds[step] == pytest.approx(flat[step], rel=1e-4), step
    logged = [r for r in records(tmp_path / "ds" / "logs") if r["split"] == "train"]
    assert all(WATCHED <= r.keys() for r in logged)


@pytest.mark.parametrize("impl", ["dpo", "rm"])
def test_tensor_parallel_equals_one_rank(tmp_path, impl):
    """tp=2 (vocab-split log-probabilities for DPO; the replicated reward head for RM, whose
    input gradient one rank passes on) trains as one rank does."""
    short = dict(train_iters=3, checkpoint_factor=None, save=None, load=None, do_test=False)
    over = dict(train_impl=impl, **short)
    train(dpo_config(tmp_path, "one", num_gpus=1, **over))
    train(dpo_config(tmp_path, "tp", model_parallel_size=2, **over))
    one, tp = losses(tmp_path / "one" / "logs"), losses(tmp_path / "tp" / "logs")
    if impl == "dpo":
        assert one[1] == pytest.approx(math.log(2), abs=1e-4)
    assert one[3] != one[1]
    for step in (1, 2, 3):
        assert tp[step] == pytest.approx(one[step], rel=1e-4, abs=1e-5), step
    if impl == "dpo":
        # Stopped after step 2 and resumed at tp=2: each tensor-parallel rank takes its own
        # shard of the reference weights back from its own client state file.
        part = dict(train_impl=impl, train_iters=3, checkpoint_factor=2, do_test=False)
        train(dpo_config(tmp_path, "tp_part", model_parallel_size=2, exit_interval=2, **part))
        shutil.rmtree(tmp_path / "tp_part" / "logs")
        train(dpo_config(tmp_path, "tp_part", model_parallel_size=2, **part))
        resumed = losses(tmp_path / "tp_part" / "logs")
        assert sorted(resumed) == [3]
        assert resumed[3] == pytest.approx(one[3], rel=1e-4, abs=1e-5)


def test_kto_through_train_py(tmp_path):
    """KTO's rewarded answers through the loop: its step-1 loss is gpt-neox's 0.25 (policy =
    reference) and its metrics are logged."""
    keys = rewarded_keys(tmp_path / "kto")
    cfg = write_config(
        tmp_path,
        "kto",
        data_path=None,
        train_impl="kto",
        pack_impl="unpacked",
        kto_beta=0.5,
        seq_length=16,
        max_position_embeddings=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        train_micro_batch_size_per_gpu=4,
        train_iters=3,
        checkpoint_factor=None,
        save=None,
        load=None,
        **keys,
    )
    train(cfg)
    kto = losses(tmp_path / "kto" / "logs")
    assert kto[1] == pytest.approx(0.25, abs=1e-5)
    logged = [r for r in records(tmp_path / "kto" / "logs") if r["split"] == "train"]
    assert all(
        {"kl", "reward_acc", "chosen_rewards", "rejected_rewards"} <= r.keys() for r in logged
    )


def test_bf16_reference_is_the_policys_own_weights(tmp_path):
    """Under bf16 the reference copy is bf16 too, the very weights the policy starts from: the
    step-1 loss is still exactly log 2."""
    short = dict(train_iters=2, checkpoint_factor=None, save=None, load=None, do_test=False)
    train(dpo_config(tmp_path, "bf16", bf16={"enabled": True}, **short))
    bf16 = losses(tmp_path / "bf16" / "logs")
    assert bf16[1] == pytest.approx(math.log(2), abs=1e-4)
    assert math.isfinite(bf16[2])
