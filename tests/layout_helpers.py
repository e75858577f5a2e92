"""The parallel layout matrix, trained once per test session and shared: the loss equivalence
(tests/parallel/test_train_layouts.py), consolidation, export, relayout and generation
(tests/checkpoint) all read the same runs, through the `trained` fixture (tests/conftest.py)."""

import shutil
from pathlib import Path

from neox.prep.tokenizer_training import train_bpe_tokenizer
from tests.train_helpers import ROOT, make_dataset, train, write_config

# One tiny untied (Pythia-like) model, 5 fp32 Adam steps with clipping. The data's ids are random
# below 256, valid for the 320-token BPE; the padded vocabulary is pinned so that every layout
# trains the same 512-row model.
MODEL = dict(
    tokenizer_type="HFTokenizer",
    padded_vocab_size=512,
    no_weight_tying=True,
    train_iters=5,
    checkpoint_factor=3,
    eval_interval=100,
    do_test=False,
    gradient_clipping=0.5,
)
# ZeRO-1 where unset: DeepSpeed 0.19.8 clips fp32 pipeline gradients wrongly without ZeRO.
# The dense run accumulates 2 micro-batches of 2; DP=2 runs one micro-batch of 2 per rank:
# the same 4 samples per step, averaged the same way.
DP2 = dict(num_gpus=2, gradient_accumulation_steps=1)
LAYOUTS = {
    "dense": dict(num_gpus=1),
    "tp2": dict(num_gpus=2, model_parallel_size=2),
    "pp2": dict(num_gpus=2, pipe_parallel_size=2),
    "zero1": dict(DP2),
    "zero2": dict(DP2, zero_optimization={"stage": 2}),
    "zero3": dict(DP2, zero_optimization={"stage": 3}),
    "tp2_pp2": dict(num_gpus=4, model_parallel_size=2, pipe_parallel_size=2),
}
# The checkpoint the checkpoint tests read: the step-3 save (the step-5 one is removed).
SAVED_STEP = 3


def bpe_tokenizer(tmp: Path) -> Path:
    """A 320-token byte-level BPE (tokenizers JSON) trained on the project's own docs."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    (tmp / "docs.txt").write_text("\n\n".join(p.read_text() for p in docs))
    return train_bpe_tokenizer([str(tmp / "docs.txt")], tmp / "tokenizer.json", vocab_size=320)


class TrainedRuns:
    """Layout name -> the save directory of its run (logs in ../logs), trained on first use."""

    def __init__(self, tmp: Path, tokenizer: Path) -> None:
        self.tmp, self.tokenizer, self.saves = tmp, tokenizer, {}
        make_dataset(tmp / "data" / "chars")

    def __getitem__(self, name: str) -> Path:
        if name not in self.saves:
            config = write_config(
                self.tmp, name, vocab_file=str(self.tokenizer), **MODEL, **LAYOUTS[name]
            )
            train(config)
            save = self.tmp / name / "ckpt"
            shutil.rmtree(save / f"global_step{MODEL['train_iters']}")
            (save / "latest").write_text(f"global_step{SAVED_STEP}")
            self.saves[name] = save
        return self.saves[name]

    def logs(self, name: str) -> Path:
        """The run's log_dir (metrics.jsonl), after training it if it has not run yet."""
        return self[name].parent / "logs"
