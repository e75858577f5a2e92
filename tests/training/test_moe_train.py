"""gpt-neox's MoE configs, at a tiny size, train on 2 CPU ranks and learn; the router's losses
and expert load reach metrics.jsonl."""

from pathlib import Path

import numpy as np
import pytest

from neox.data.indexed import IndexedDatasetBuilder
from tests.train_helpers import ROOT, records, train, write_config

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


@pytest.mark.parametrize("name", ["125M-dmoe", "125M-moe"])
def test_gpt_neox_moe_config_learns_on_two_ranks(tmp_path, name):
    text_dataset(tmp_path / "data" / "chars")
    tiny = write_config(
        tmp_path,
        name,
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
        save=None,
        load=None,
        eval_interval=100,
        do_test=False,
        vocab_file=None,
        merge_file=None,
        hostfile=None,
    )
    train(ROOT / "configs" / f"{name}.yml", ROOT / "configs" / "cpu.yml", tiny)
    steps = [r for r in records(tmp_path / name / "logs") if r["split"] == "train"]
    first, last = steps[0]["loss"], steps[-1]["loss"]
    assert last < first - 1.0, (first, last)  # from ln(vocab) towards the bytes' entropy
    load = [steps[-1][f"moe/{layer}/load/{e}"] for layer in (0, 1) for e in range(4)]
    assert sum(load) == pytest.approx(2.0)  # per layer the fractions add up to one
    assert steps[-1]["moe/0/balance_loss"] > 0.9  # E * sum f P: 1 when balanced
    dropped = steps[-1]["moe/0/dropped"]
    assert dropped == 0 if name == "125M-dmoe" else 0 <= dropped < 0.5
