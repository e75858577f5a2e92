"""DPO, KTO and reward-model training on a tiny model, in process, through neox's flat engine:
the step-0 loss of DPO with policy = reference is log 2, and a few hundred steps on a synthetic
preference set (tests/preference_helpers.py) teach each objective its rule."""

import copy
import math

import pytest
import torch

from neox.config import load_dict
from neox.data.pairs import build_preference_dataset
from neox.model import build_model
from neox.training.flat_engine import FlatEngine, FlatSettings
from neox.training.optim import param_groups
from neox.training.preference import (
    REFERENCE_KEY,
    attach_reward_head,
    build_objective,
    documents_batch,
    needs_reference,
    token_logps,
)
from tests.preference_helpers import VOCAB, pair_keys, rewarded_keys

MODEL = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    max_position_embeddings=16,
    pos_emb="rotary",
    rotary_pct=0.25,
    no_weight_tying=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def config(tmp_path, impl, **extra):
    keys = rewarded_keys(tmp_path / "kto") if impl == "kto" else pair_keys(tmp_path / "pairs")
    flat = {**MODEL, "train_impl": impl, "pack_impl": "unpacked", "num_workers": 0, **keys}
    if impl in ("dpo", "rm"):
        flat["dataset_impl"] = "pairwise"
    return load_dict({**flat, **extra})


def samples(cfg, split, n, batch):
    data = build_preference_dataset(cfg, split, n, cfg.training.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)
    return iter(loader)


def setup(cfg, lr=1e-2):
    """(engine, objective) as build_run makes them, on one rank without torch.distributed."""
    model = build_model(cfg.model, VOCAB, seed=1)
    if cfg.preference.train_impl == "rm":
        attach_reward_head(model, seed=1)
    reference = copy.deepcopy(model) if needs_reference(cfg) else None
    objective = build_objective(cfg, None, reference)
    opt = torch.optim.AdamW(param_groups(model, 0.0), lr=lr, betas=(0.9, 0.95))
    settings = FlatSettings(micro_batch=8, clip=1.0, zero_stage=1)
    engine = FlatEngine(settings, model, opt, None, objective)
    objective.start(engine.module, None)
    return engine, objective


def micro_batches(objective, stream):
    while True:
        yield objective.batch(next(stream), torch.device("cpu"))


def held_out_metrics(engine, objective, cfg):
    engine.eval()
    objective.take_metrics()
    stream = samples(cfg, "valid", 64, 64)
    with torch.no_grad():
        engine.eval_batch(micro_batches(objective, stream))
    engine.train()
    return {k: v.item() for k, v in objective.take_metrics().items()}


def train(engine, objective, cfg, steps):
    stream = samples(cfg, "train", steps * 8, 8)
    batches = micro_batches(objective, stream)
    losses = [engine.train_batch(batches).loss.item() for _ in range(steps)]
    return losses, objective.take_metrics()


def test_dpo_loss_at_step_zero_is_log_2(tmp_path):
    cfg = config(tmp_path, "dpo", dpo_beta=0.5)
    engine, objective = setup(cfg)
    batch = next(micro_batches(objective, samples(cfg, "train", 8, 8)))
    loss = objective(engine, batch)
    assert abs(loss.item() - math.log(2)) < 1e-4
    m = objective.take_metrics()
    assert m["chosen_rewards"].item() == pytest.approx(0.0, abs=1e-5)
    assert m["margins"].item() == pytest.approx(0.0, abs=1e-5)
    # The policy's own log-probabilities do move the loss: one step later it is below log 2.
    losses, _ = train(engine, objective, cfg, 3)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4) and losses[-1] < losses[0]


def test_dpo_learns_the_rule_with_the_reference_frozen(tmp_path):
    cfg = config(tmp_path, "dpo", dpo_beta=0.5)
    engine, objective = setup(cfg)
    before = copy.deepcopy(objective.reference.module.state_dict())
    assert held_out_metrics(engine, objective, cfg)["reward_acc"] < 0.9
    losses, _ = train(engine, objective, cfg, 200)
    held = held_out_metrics(engine, objective, cfg)
    assert held["reward_acc"] > 0.9, held
    assert held["chosen_rewards"] > held["rejected_rewards"] and held["margins"] > 0
    assert sum(losses[-20:]) / 20 < 0.5 * math.log(2)
    # The reference never trains and sits outside the optimizer.
    after = objective.reference.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(p.requires_grad for p in objective.reference.module.parameters())
    assert objective.checkpoint_state()[REFERENCE_KEY].keys() == before.keys()


def test_dpo_reference_free_keeps_no_reference(tmp_path):
    cfg = config(tmp_path, "dpo", dpo_reference_free=True)
    engine, objective = setup(cfg)
    assert objective.reference is None and objective.checkpoint_state() == {}
    losses, _ = train(engine, objective, cfg, 5)
    assert all(math.isfinite(x) for x in losses)


def test_kto_learns_the_rule(tmp_path):
    cfg = config(tmp_path, "kto", kto_beta=0.5, train_micro_batch_size_per_gpu=8)
    engine, objective = setup(cfg)
    batch = next(micro_batches(objective, samples(cfg, "train", 8, 8)))
    # Policy = reference: every ratio and the KL baseline are 0, so each sample costs
    # w * (1 - sigmoid(0)) and gpt-neox's loss is half their mean.
    assert objective(engine, batch).item() == pytest.approx(0.25, abs=1e-5)
    objective.take_metrics()
    assert held_out_metrics(engine, objective, cfg)["reward_acc"] < 0.9
    losses, _ = train(engine, objective, cfg, 60)
    held = held_out_metrics(engine, objective, cfg)
    assert held["reward_acc"] > 0.9, held
    assert held["chosen_rewards"] > 0 > held["rejected_rewards"] and held["margins"] > 0
    assert sum(losses[-10:]) / 10 < 0.5 * 0.25


def test_kto_weights_each_kind(tmp_path):
    cfg = config(tmp_path, "kto", kto_desirable_weight=2.0, kto_undesirable_weight=0.0)
    engine, objective = setup(cfg)
    batch = next(micro_batches(objective, samples(cfg, "train", 8, 8)))
    desirable = (batch.rewards > 0).float().mean().item()
    assert objective(engine, batch).item() == pytest.approx(0.5 * 2.0 * 0.5 * desirable)


def test_reward_model_learns_the_rule(tmp_path):
    """lr 3e-3 for 1,200 steps: at the 1e-2 the other objectives use, the held-out accuracy
    wandered between 0.8 and 0.95 with the thread count (the order of float sums); here it is
    0.92-1.0 at 1-4 threads from step 800 on."""
    cfg = config(tmp_path, "rm")
    engine, objective = setup(cfg, lr=3e-3)
    assert engine.module.head_weight().shape == (1, MODEL["hidden_size"])
    assert held_out_metrics(engine, objective, cfg)["reward_acc"] < 0.9
    losses, _ = train(engine, objective, cfg, 1200)
    held = held_out_metrics(engine, objective, cfg)
    assert held["reward_acc"] > 0.9, held
    assert held["margins"] > 0
    assert sum(losses[-20:]) / 20 < 0.5 * math.log(2)


def test_masked_tokens_change_nothing(tmp_path):
    """Prompt tokens are inputs only: their labels are -100 and only answers are scored."""
    cfg = config(tmp_path, "dpo")
    _, objective = setup(cfg)
    sample = next(samples(cfg, "train", 4, 4))
    batch = objective.batch(sample, torch.device("cpu"))
    assert batch.tokens.shape == (8, MODEL["seq_length"])
    # Each row trains its answer token and the EOD after it, nothing else.
    assert batch.loss_mask.sum(-1).tolist() == [2.0] * 8
    logits = torch.randn(8, MODEL["seq_length"], VOCAB)
    logp = token_logps(logits, batch.labels, fp32=True)
    other = documents_batch(sample["chosen"], sample["chosen_label"])
    assert other.loss_mask.shape == (4, MODEL["seq_length"])
    assert logp.shape == batch.labels.shape


@pytest.mark.parametrize("tied", [True, False])
def test_reward_model_starts_from_a_language_models_weights(tied):
    """finetune from a pretrained checkpoint: every weight but the head loads strictly, the
    fresh reward head stays; a reward model's own weights load back head and all."""
    cfg = load_dict({**MODEL, "no_weight_tying": not tied}).model
    lm = build_model(cfg, VOCAB, seed=3).state_dict()
    rm = attach_reward_head(build_model(cfg, VOCAB, seed=1), seed=1)
    head = rm.embed_out.weight.detach().clone()
    rm.load_state_dict(lm, strict=True)
    assert torch.equal(rm.embed_out.weight, head)
    assert torch.equal(
        rm.layers[0].attention.query_key_value.weight,
        lm["layers.0.attention.query_key_value.weight"],
    )
    saved = {k: v.clone() for k, v in rm.state_dict().items()}
    saved["embed_out.weight"] += 1.0
    other = attach_reward_head(build_model(cfg, VOCAB, seed=2), seed=2)
    other.load_state_dict(saved, strict=True)
    assert torch.equal(other.embed_out.weight, saved["embed_out.weight"])
