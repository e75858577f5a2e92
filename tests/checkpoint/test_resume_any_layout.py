"""A checkpoint saved at step 2 under one layout resumes under another with its whole training
state: steps 3 and 4 lose what the uninterrupted run's do, within fp32 rounding (issue 35).

One tiny untied model, 4 fp32 Adam steps of 4 samples, the padded vocabulary pinned so every
layout trains the same tensors. The uninterrupted run and each saving run are trained once and
shared by the cases (module-scoped caches); each case adds one resumed run.
"""

import sys
from pathlib import Path

import pytest

from neox.checkpoint.plain_state import PlainState
from tests.layout_helpers import DP2
from tests.layout_helpers import MODEL as LAYOUT_MODEL
from tests.train_helpers import TWO_GPUS, losses, make_dataset, run_deepy, train, write_config

# The layout matrix's tiny model (tests/layout_helpers.py) on the char tokenizer, saved at step 2
# of 4.
MODEL = dict(LAYOUT_MODEL, tokenizer_type="CharLevelTokenizer", train_iters=4, checkpoint_factor=2)
LAYOUTS = {
    "one": dict(num_gpus=1),
    "flat_dp2": dict(DP2),  # neox's flat engine (ZeRO-1 partitions)
    "ds_zero1_dp2": dict(DP2, flat_engine=False),
    "ds_zero3_dp2": dict(DP2, flat_engine=False, zero_optimization={"stage": 3}),
    "tp2": dict(num_gpus=2, model_parallel_size=2),
    "pp2": dict(num_gpus=2, pipe_parallel_size=2),
}
CASES = [
    ("pp2", "flat_dp2"),
    ("tp2", "pp2"),
    ("ds_zero1_dp2", "ds_zero3_dp2"),
    ("flat_dp2", "ds_zero1_dp2"),
    ("ds_zero1_dp2", "flat_dp2"),
    ("flat_dp2", "one"),
    ("ds_zero3_dp2", "one"),  # each ZeRO-3 rank writes its own slices; one rank joins them
]
TOLERANCE = 2e-4


# The same on 4 GPUs (`pytest -m multigpu`): every 4-rank layout steps the same 4 samples.
DP4 = dict(num_gpus=4, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
GPU_LAYOUTS = {
    "one": dict(num_gpus=1),
    "tp2_pp2": dict(num_gpus=4, model_parallel_size=2, pipe_parallel_size=2),
    "tp4": dict(num_gpus=4, model_parallel_size=4),
    "flat_dp4": dict(DP4),
    "ds_zero3_dp4": dict(DP4, flat_engine=False, zero_optimization={"stage": 3}),
}
# On one GPU (`pytest -m gpu`): the flat engine and DeepSpeed's ZeRO-3 save and load on CUDA.
ONE_GPU_LAYOUTS = dict(
    LAYOUTS, ds_zero3_one=dict(num_gpus=1, flat_engine=False, zero_optimization={"stage": 3})
)
ONE_GPU_CASES = [("one", "ds_zero3_one"), ("ds_zero3_one", "one")]
# On 2 GPUs (`pytest -m gpu`, NCCL): each engine saves and loads once on CUDA.
TWO_GPU_CASES = [
    ("tp2", "ds_zero3_dp2"),
    ("ds_zero3_dp2", "pp2"),
    ("pp2", "flat_dp2"),
    ("flat_dp2", "one"),
]
GPU_CASES = [
    ("tp2_pp2", "ds_zero3_dp4"),
    ("ds_zero3_dp4", "tp4"),
    ("tp4", "flat_dp4"),
    ("flat_dp4", "one"),
]


class Runs:
    def __init__(self, tmp: Path, layouts: dict = LAYOUTS, train=train) -> None:
        self.tmp, self.layouts, self.train = tmp, layouts, train
        make_dataset(tmp / "data" / "chars")
        self.saved: dict[str, Path] = {}
        self._reference = None

    def reference(self) -> dict[int, float]:
        """The uninterrupted run's losses (one rank)."""
        if self._reference is None:
            config = write_config(
                self.tmp, "reference", save=None, load=None, **MODEL, **self.layouts["one"]
            )
            self.train(config)
            self._reference = losses(self.tmp / "reference" / "logs")
        return self._reference

    def saved_at_2(self, layout: str) -> Path:
        """The save directory of a run under `layout` that stopped after saving step 2."""
        if layout not in self.saved:
            name = f"save_{layout}"
            config = write_config(
                self.tmp, name, load=None, exit_interval=2, **MODEL, **self.layouts[layout]
            )
            self.train(config)
            self.saved[layout] = self.tmp / name / "ckpt"
        return self.saved[layout]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("any_layout"))


def _on_gpus(config: Path):
    return run_deepy("train.py", config, cpu=False)


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("any_layout_gpu"), GPU_LAYOUTS, _on_gpus)


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("any_layout_2gpu"), ONE_GPU_LAYOUTS, _on_gpus)


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", CASES, ids=[f"{a}-to-{b}" for a, b in CASES])
def test_resume_at_another_layout_continues_the_run(runs, saved, resumed):
    _resume_and_compare(runs, saved, resumed)


@pytest.mark.slow
@pytest.mark.multigpu
@pytest.mark.parametrize("saved,resumed", GPU_CASES, ids=[f"{a}-to-{b}" for a, b in GPU_CASES])
def test_resume_at_another_layout_on_four_gpus(gpu_runs, saved, resumed):
    _resume_and_compare(gpu_runs, saved, resumed)


@pytest.mark.slow
@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize(
    "saved,resumed", TWO_GPU_CASES, ids=[f"{a}-to-{b}" for a, b in TWO_GPU_CASES]
)
def test_resume_at_another_layout_on_two_gpus(cuda_runs, saved, resumed):
    _resume_and_compare(cuda_runs, saved, resumed)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize(
    "saved,resumed", ONE_GPU_CASES, ids=[f"{a}-to-{b}" for a, b in ONE_GPU_CASES]
)
def test_resume_at_another_engine_on_one_gpu(cuda_runs, saved, resumed):
    _resume_and_compare(cuda_runs, saved, resumed)


def _resume_and_compare(runs: Runs, saved: str, resumed: str) -> None:
    load = runs.saved_at_2(saved)
    assert (load / "global_step2" / "state" / "meta.json").is_file()
    name = f"resume_{saved}_to_{resumed}"
    keys = runs.layouts[resumed]
    config = write_config(runs.tmp, name, load=str(load), save=None, **MODEL, **keys)
    result = runs.train(config)
    assert "from its state by plain name" in result.stdout + result.stderr
    got = losses(runs.tmp / name / "logs")
    want = runs.reference()
    assert sorted(got) == [3, 4]  # resumed after step 2, not from scratch
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], abs=TOLERANCE), (step, got, want)


def write_deepspeed_files(rank: int, world: int, step_dir: str, out: str) -> None:
    """Rank body: DeepSpeed's engine at ZeRO-1 takes a checkpoint's state by plain name and
    saves it with its own save_checkpoint, in DeepSpeed's files (as gpt-neox writes them)."""
    from neox.checkpoint.consolidate import read_checkpoint_config
    from neox.config import derive
    from neox.model import build_model
    from neox.training.setup import make_engine

    cfg = read_checkpoint_config(Path(step_dir))
    derived = derive(cfg, world)
    model = build_model(cfg.model, derived.padded_vocab_size, seed=cfg.training.seed)
    engine = make_engine(cfg, derived, model, None)
    state = PlainState(Path(step_dir))
    engine.load_plain(state, load_optimizer_states=True)
    engine.ds.save_checkpoint(out, tag=Path(step_dir).name, client_state=state.client_state)


def write_universal_files(rank: int, world: int, step_dir: str, out: str, universal: str) -> None:
    """Rank body: write_deepspeed_files, then DeepSpeed's own ds_to_universal on them, here
    (its command line's main, one extract and merge worker: no process pools, and no second
    interpreter importing DeepSpeed)."""
    from deepspeed.checkpoint import ds_to_universal

    write_deepspeed_files(rank, world, step_dir, out)
    tag = Path(step_dir).name
    sys.argv = [
        "ds_to_universal",
        *("--input_folder", str(Path(out) / tag), "--output_folder", f"{universal}/{tag}"),
        *("--num_extract_workers", "1", "--num_merge_workers", "1"),
        "--inject_missing_state",
    ]
    ds_to_universal.main(ds_to_universal.parse_arguments())


@pytest.mark.slow
def test_a_deepspeed_universal_checkpoint_resumes(runs):
    """DeepSpeed's own ds_to_universal turns a ZeRO-1 checkpoint of DeepSpeed's engine (the
    ZeRO-1 run's step 2, saved by DeepSpeed's save_checkpoint) into a universal one
    (zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt); the flat engine resumes it."""
    from tests.parallel.rank_helpers import run_ranks

    ds_files, universal = runs.tmp / "deepspeed_files", runs.tmp / "universal"
    step2 = runs.saved_at_2("ds_zero1_dp2") / "global_step2"
    run_ranks(write_universal_files, 1, str(step2), str(ds_files), str(universal))
    assert (ds_files / "global_step2").is_dir()  # DeepSpeed's own files, converted
    assert (universal / "global_step2" / "zero" / "embed_in.weight" / "exp_avg.pt").is_file()
    (universal / "latest").write_text("global_step2")
    name = "resume_universal"
    config = write_config(
        runs.tmp, name, load=str(universal), save=None, **MODEL, **LAYOUTS["flat_dp2"]
    )
    result = train(config)
    assert "deepspeed universal checkpoint" in result.stdout + result.stderr
    got, want = losses(runs.tmp / name / "logs"), runs.reference()
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], abs=TOLERANCE), (step, got, want)


@pytest.mark.slow
def test_an_sgd_run_saves_and_resumes_its_weights_at_another_layout(runs):
    """SGD keeps no Adam moments: DeepSpeed's engine saves its state by name without them, and
    a run at another layout resumes the weights and counters (its momentum is not carried)."""
    sgd = dict(MODEL, optimizer={"type": "SGD", "params": {"lr": 1.0e-2, "momentum": 0.9}})
    save = write_config(runs.tmp, "sgd_save", load=None, exit_interval=2, **sgd, **DP2)
    train(save)
    load = runs.tmp / "sgd_save" / "ckpt"
    assert not any("exp_avg" in k for k in PlainState(load / "global_step2").entries)
    resume = write_config(
        runs.tmp, "sgd_resume", load=str(load), save=None, **sgd, **LAYOUTS["tp2"]
    )
    result = train(resume)
    assert "from its state by plain name" in result.stdout + result.stderr
    assert sorted(losses(runs.tmp / "sgd_resume" / "logs")) == [3, 4]
