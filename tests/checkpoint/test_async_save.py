"""async_save: the background write waits for the one before it, a rank's failure stops the
publish, and a kill -9 mid-write never yields a checkpoint taken as good (issue 35, part 2)."""

import threading

import pytest

from neox.checkpoint import async_save
from neox.checkpoint.consolidate import load_model_state
from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.find import find_checkpoint
from neox.checkpoint.manifest import MANIFEST
from neox.model import build_model
from tests.train_helpers import losses, make_dataset, run_here, write_config


def test_a_second_save_waits_for_the_first():
    order: list[int] = []
    release = threading.Event()

    def first() -> None:
        release.wait()
        order.append(1)

    def second() -> None:
        order.append(2 if order == [1] else -2)  # -2: it ran while the first was writing

    async_save.start(first)
    starter = threading.Thread(target=async_save.start, args=(second,))
    starter.start()
    release.set()
    starter.join()
    async_save.wait_for_save()
    assert order == [1, 2]


def test_a_rank_that_could_not_write_stops_the_publish_with_one_line(tmp_path):
    staging = tmp_path / "global_step2.partial"
    (staging / "state").mkdir(parents=True)
    async_save.mark_done(staging, 0, [])
    async_save.mark_failed(staging, 1, OSError(28, "No space left on device"))
    with pytest.raises(CheckpointError, match=r"rank 1 could not write its part of global_step2"):
        async_save.gather_done(staging, 2)


def test_the_error_of_a_background_save_reaches_the_training_thread():
    def fail() -> None:
        raise CheckpointError("disk gone")

    async_save.start(fail)
    with pytest.raises(CheckpointError, match="disk gone"):
        async_save.wait_for_save()
    async_save.wait_for_save()  # raised once


@pytest.mark.slow
def test_kill_during_a_background_write_publishes_nothing_and_the_run_resumes(tmp_path):
    make_dataset(tmp_path / "data" / "chars")
    run = dict(
        num_gpus=2,
        gradient_accumulation_steps=1,
        train_iters=4,
        checkpoint_factor=1,
        eval_interval=100,
        do_test=False,
        padded_vocab_size=512,
        async_save=True,
    )
    cfg = write_config(tmp_path, "async", **run)
    r = run_here("train.py", cfg, check=False, NEOX_SAVE_KILL_AT="async_write@0:2")
    assert r.returncode != 0
    ckpt = tmp_path / "async" / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step1"
    partial = ckpt / "global_step2.partial"
    assert partial.is_dir() and not (partial / MANIFEST).exists()
    assert not (ckpt / "global_step2").exists()
    assert find_checkpoint(str(ckpt)).tag == "global_step1"
    crashed = losses(tmp_path / "async" / "logs")

    r = run_here("train.py", cfg)
    assert "(checkpoint global_step1)" in r.stdout
    assert "written in the background" in r.stdout + r.stderr
    resumed = losses(tmp_path / "async" / "logs")
    # Step 2 again, from the step-1 state the background write published: the same loss.
    assert resumed[2] == pytest.approx(crashed[2], abs=2e-4)
    assert (ckpt / "latest").read_text() == "global_step4"
    assert (ckpt / "global_step4" / MANIFEST).is_file() and not partial.exists()
    # The tools read it too (state/ alone): every parameter of the plain model, by name.
    cfg_saved, sd = load_model_state(ckpt)
    assert set(sd) == set(build_model(cfg_saved.model, 512, device="meta").state_dict())


@pytest.mark.parametrize("tp", [1, 2])
def test_the_estimate_counts_the_host_copy(tp):
    """12 bytes (fp32 weight, two Adam moments) per element of this rank's model shard."""
    from neox.config import derive, load_dict
    from neox.model import build_model
    from neox.plan.memory import estimate_memory, training_shape

    keys = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64)
    keys.update(max_position_embeddings=64, model_parallel_size=tp, padded_vocab_size=512)
    with_copy = load_dict(dict(keys, async_save=True))
    without = load_dict(keys)
    derived = derive(with_copy, 2)
    est = estimate_memory(with_copy.model, training_shape(with_copy, derived, 512, device="cpu"))
    base = estimate_memory(without.model, training_shape(without, derived, 512, device="cpu"))
    elements = sum(p.numel() for p in build_model(with_copy.model, 512).parameters())
    assert base.host_checkpoint_staging == 0
    # Whole elements per tensor-parallel rank: the replicated norms and biases are not split.
    assert elements / tp <= est.host_checkpoint_staging / 12 <= elements
    if tp == 1:
        assert est.host_checkpoint_staging == 12 * elements
    assert est.host_total - base.host_total == est.host_checkpoint_staging
