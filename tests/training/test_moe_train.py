"""gpt-neox's MoE configs, at a tiny size, train on 2 CPU ranks and learn; the router's losses
and expert load reach metrics.jsonl."""

from pathlib import Path

import numpy as np
import pytest

from neox.data.indexed import IndexedDatasetBuilder
from tests.train_helpers import ROOT, losses, records, train, write_config

pytestmark = pytest.mark.slow

SHAKESPEARE = Path("/work/shared/data/tinyshakespeare.txt")


def text_dataset(prefix: Path) -> None:
    """Tiny Shakespeare (or this repository's README where it is absent) as byte ids, in
    documents of 200 bytes: text with something to learn, unlike random ids."""
    text = (SHAKESPEARE if SHAKESPEARE.is_file() else ROOT / "README.md").read_bytes()[:60_000]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for start in range(0, len(text), 200):
        doc = np.frombuffer(text[start : start + 200], dtype=np.uint8).astype(np.uint16)
        builder.add_item(np.append(np.maximum(doc, 1), 0))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def tiny(tmp_path: Path, name: str, **overrides) -> Path:
    """gpt-neox's MoE file at 2 layers of width 32, 4 experts, 16 steps on 2 CPU ranks; saves
    nothing unless overrides set checkpoint_factor."""
    saves = overrides.get("checkpoint_factor") is not None
    keys = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        moe_num_experts=4,
        moe_expert_interval=1,
        train_iters=16,
        lr_decay_iters=16,
        warmup=0.1,
        optimizer={"type": "Adam", "params": {"lr": 3.0e-3}},
        checkpoint_factor=None,
        eval_interval=100,
        do_test=False,
        vocab_file=None,
        merge_file=None,
        hostfile=None,
    )
    if not saves:
        keys.update(save=None, load=None)
    return write_config(tmp_path, name, **{**keys, **overrides})


def gpt_neox_file(name: str) -> list[Path]:
    return [ROOT / "configs" / f"{name}.yml", ROOT / "configs" / "cpu.yml"]


@pytest.mark.parametrize("name", ["125M-dmoe", "125M-moe"])
def test_gpt_neox_moe_config_learns_on_two_ranks(tmp_path, name):
    text_dataset(tmp_path / "data" / "chars")
    train(*gpt_neox_file(name), tiny(tmp_path, name))
    steps = [r for r in records(tmp_path / name / "logs") if r["split"] == "train"]
    first, last = steps[0]["loss"], steps[-1]["loss"]
    assert last < first - 1.0, (first, last)  # from ln(vocab) towards the bytes' entropy
    load = [steps[-1][f"moe/{layer}/load/{e}"] for layer in (0, 1) for e in range(4)]
    assert sum(load) == pytest.approx(2.0)  # per layer the fractions add up to one
    assert steps[-1]["moe/0/balance_loss"] > 0.9  # E * sum f P: 1 when balanced
    dropped = steps[-1]["moe/0/dropped"]
    assert dropped == 0 if name == "125M-dmoe" else 0 <= dropped < 0.5


def test_moe_run_resumes_exactly_across_expert_parallel_sizes(tmp_path):
    """Stopped at step 8 and resumed with its experts split over the 2 ranks, a top-1 run with
    token dropping logs the losses of an uninterrupted one (experts, router and their optimizer
    states all restored; the checkpoint does not depend on the expert-parallel size)."""
    text_dataset(tmp_path / "data" / "chars")
    files = gpt_neox_file("125M-moe")
    train(*files, tiny(tmp_path, "full"))
    train(*files, tiny(tmp_path, "part", exit_interval=8, checkpoint_factor=8))
    r = train(*files, tiny(tmp_path, "part", checkpoint_factor=8, moe_expert_parallel_size=2))
    assert "resuming from" in r.stdout
    full, part = losses(tmp_path / "full" / "logs"), losses(tmp_path / "part" / "logs")
    assert sorted(part) == list(range(1, 17))
    for step in range(9, 17):
        assert part[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step


@pytest.fixture(scope="module")
def data_parallel_run(tmp_path_factory) -> dict[int, float]:
    """The dropless MoE file's losses on 2 data-parallel ranks, ZeRO-1 (the flat engine)."""
    tmp = tmp_path_factory.mktemp("moe_dp2")
    text_dataset(tmp / "data" / "chars")
    train(*gpt_neox_file("125M-dmoe"), tiny(tmp, "dp2", train_iters=6))
    return losses(tmp / "dp2" / "logs")


@pytest.mark.parametrize(
    "layout",
    [
        {"model_parallel_size": 2, "gradient_accumulation_steps": 4},
        {"moe_expert_parallel_size": 2},
        {"zero_optimization": {"stage": 2}, "moe_expert_parallel_size": 2},
        {"zero_optimization": {"stage": 3}, "moe_expert_parallel_size": 2},
    ],
    ids=["tp2", "ep2", "zero2-ep2", "zero3-ep2"],
)
def test_moe_layouts_match_data_parallel(tmp_path, data_parallel_run, layout):
    """Under tensor parallelism (experts replicated, attention split), with the experts split
    over the 2 ranks (all-to-all dispatch; the flat engine, and DeepSpeed's under ZeRO-2 and
    ZeRO-3, which partitions the stacked experts) the dropless MoE run logs the losses of the
    data-parallel run with the same global batch."""
    text_dataset(tmp_path / "data" / "chars")
    train(*gpt_neox_file("125M-dmoe"), tiny(tmp_path, "other", train_iters=6, **layout))
    other = losses(tmp_path / "other" / "logs")
    assert sorted(other) == list(range(1, 7))
    for step, loss in data_parallel_run.items():
        # fp32; the reductions run in another order across ranks.
        assert other[step] == pytest.approx(loss, rel=1e-5), (step, data_parallel_run, other)
