"""Checkpoints trained once per test session through deepy.py, one per parallel layout."""

from pathlib import Path

import pytest

from neox.prep.tokenizer_training import train_bpe_tokenizer
from tests.train_helpers import ROOT, make_dataset, train, write_config

# One tiny untied (Pythia-like) model, trained 3 steps and saved at step 3 in every layout.
# The data's ids are random below 256, valid for the 320-token BPE; the padded vocabulary is
# pinned so that every layout trains the same 512-row model.
MODEL = dict(
    tokenizer_type="HFTokenizer",
    padded_vocab_size=512,
    no_weight_tying=True,
    train_iters=3,
    checkpoint_factor=3,
    eval_interval=100,
    do_test=False,
)
DP2 = dict(num_gpus=2, gradient_accumulation_steps=1)
LAYOUTS = {
    "dense": dict(num_gpus=1),
    "tp2": dict(num_gpus=2, model_parallel_size=2),
    "pp2": dict(num_gpus=2, pipe_parallel_size=2),
    "zero2": dict(DP2, zero_optimization={"stage": 2}),
    "zero3": dict(DP2, zero_optimization={"stage": 3}),
}


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory) -> Path:
    """A 320-token byte-level BPE (tokenizers JSON) trained on the project's own docs."""
    tmp = tmp_path_factory.mktemp("tokenizer")
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    (tmp / "docs.txt").write_text("\n\n".join(p.read_text() for p in docs))
    return train_bpe_tokenizer([str(tmp / "docs.txt")], tmp / "tokenizer.json", vocab_size=320)


class TrainedRuns:
    """Layout name -> the save directory of its 3-step run, trained on first use."""

    def __init__(self, tmp: Path, tokenizer: Path) -> None:
        self.tmp, self.tokenizer, self.saves = tmp, tokenizer, {}
        make_dataset(tmp / "data" / "chars")

    def __getitem__(self, name: str) -> Path:
        if name not in self.saves:
            config = write_config(
                self.tmp, name, vocab_file=str(self.tokenizer), **MODEL, **LAYOUTS[name]
            )
            train(config)
            self.saves[name] = self.tmp / name / "ckpt"
        return self.saves[name]


@pytest.fixture(scope="session")
def trained(tmp_path_factory, bpe_tokenizer) -> TrainedRuns:
    return TrainedRuns(tmp_path_factory.mktemp("layouts"), bpe_tokenizer)
