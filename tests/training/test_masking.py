"""Label masks in training: masked positions contribute exactly nothing, and the step's loss is
the mean over the trained tokens of the whole global batch, in every layout and both engines
(real gloo ranks, the real engines, SGD so that a wrongly scaled gradient shows in the losses)."""

import json

import pytest
import torch

from neox.training.engine import forward_loss, weigh_micro_batches
from tests.parallel.rank_helpers import run_ranks
from tests.training.masking_helpers import (
    STEPS,
    TRAINED,
    global_batch,
    reference_losses,
    run_cases,
    split,
)

TRAINED_TOKENS = sum(b - a for a, b in filter(None, TRAINED))


def test_reference_normalisation_is_not_the_per_micro_batch_mean():
    """The test below could fail: averaging per-micro-batch means (the old normalisation) over
    these uneven masks trains differently from the global mean."""
    right, biased = reference_losses(), reference_losses(per_micro_batch_of=2)
    assert right[0] != pytest.approx(biased[0], rel=1e-3)
    assert right[2] < right[0] - 1e-3  # and SGD trains


def test_uneven_micro_batches_weigh_to_one_big_batch():
    """In one process: the weighted micro-batch losses, averaged as the engines average them,
    give the loss and gradient of the one batch holding them all."""
    from neox.config.model import ModelConfig
    from neox.model import build_model
    from tests.training.masking_helpers import MODEL, SEED, VOCAB

    net = build_model(ModelConfig(**MODEL), VOCAB, seed=SEED)
    whole = global_batch(False)
    loss = forward_loss(net, whole)
    loss.backward()
    want = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    micro = split(whole, 0, 1, 4)  # one sample each: 2, 12, 0 and 7 trained tokens
    count = weigh_micro_batches(micro, world=1)
    assert count.item() == TRAINED_TOKENS
    assert [round(b.loss_weight.item() * TRAINED_TOKENS / 4) for b in micro] == [2, 12, 0, 7]
    total = sum(forward_loss(net, b) for b in micro) / 4
    total.backward()
    assert total.item() == pytest.approx(loss.item(), rel=1e-6)
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7)


def test_without_masks_the_weights_are_exactly_one():
    """Pretraining batches (every token trained) keep their losses bit for bit."""
    text = torch.randint(0, 50, (2, 9))
    from neox.data.batch import build_batch

    batches = [build_batch(text, 0), build_batch(text.flip(0), 0)]
    weigh_micro_batches(batches, world=1)
    assert [b.loss_weight.item() for b in batches] == [1.0, 1.0]


def _check(out_dir, names):
    want = reference_losses()
    assert want == reference_losses(poisoned=True)
    for name in names:
        got = json.loads((out_dir / f"{name}.json").read_text())
        clean, poisoned = got["clean"], got["poisoned"]
        assert len(clean["losses"]) == STEPS
        # Random targets where masked and random inputs after the last trained token: the
        # same losses, hence the same gradients, step after step.
        assert poisoned["losses"] == pytest.approx(clean["losses"], rel=1e-6, abs=0), name
        assert clean["losses"] == pytest.approx(want, rel=1e-5), f"{name}: {clean} vs {want}"
        assert clean["trained_tokens"] == [TRAINED_TOKENS] * STEPS, name


@pytest.mark.slow
def test_masked_training_matches_the_dense_global_mean_in_every_layout(tmp_path):
    names = ["flat_dp2", "zero1_dp2", "tp2", "pp2"]
    run_ranks(run_cases, 2, names, str(tmp_path))
    _check(tmp_path, names)


@pytest.mark.slow
def test_masked_training_with_data_parallel_inside_model_parallel(tmp_path):
    names = ["tp2_dp2", "pp2_dp2"]
    run_ranks(run_cases, 4, names, str(tmp_path))
    _check(tmp_path, names)
