"""Layout change: reshape_checkpoint keeps every weight and carries the optimizer state (its
output resumes as the uninterrupted run goes on); a finetune run at another TP/PP starts from
exactly the consolidated weights; weights-only checkpoints cannot be resumed."""

import subprocess
import sys

import pytest
import torch

from neox.checkpoint.consolidate import CheckpointError, load_model, load_model_state
from neox.checkpoint.relayout import reshape_checkpoint
from neox.checkpoint.writer import WEIGHTS_ONLY
from neox.model import lm_loss
from tests.hf.test_hf_import import write_constant_dataset
from tests.layout_helpers import LAYOUTS, MODEL
from tests.process_helpers import child_env
from tests.train_helpers import ROOT, losses, make_dataset, train, write_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2), (1, 1)])
def test_reshape_keeps_every_weight(trained, tmp_path, tp, pp):
    tag = reshape_checkpoint(trained["tp2"], tmp_path / "out", tp, pp)
    assert tag == tmp_path / "out" / "global_step3" and not (tag / WEIGHTS_ONLY).exists()
    assert (tag / "state" / "meta.json").is_file()
    _, before = load_model_state(trained["tp2"])
    cfg, after = load_model_state(tmp_path / "out")
    assert (cfg.parallel.model_parallel_size, cfg.parallel.pp) == (tp, pp)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_reshape_refuses_before_writing(trained, tmp_path):
    with pytest.raises(
        CheckpointError, match=r"num_attention_heads=4 is not divisible by model_parallel_size=3"
    ):
        reshape_checkpoint(trained["tp2"], tmp_path / "out", 3, 1)
    assert not (tmp_path / "out").exists()
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "reshape_checkpoint.py"),
            *("--input_dir", trained["tp2"], "--output_dir", tmp_path / "out", "--tp", "1"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "with its optimizer state" in r.stdout


def test_a_reshaped_checkpoint_resumes_as_the_run_went_on(trained, bpe_tokenizer, tmp_path):
    """tp2's step-3 checkpoint reshaped to pp2, resumed there: steps 4 and 5 lose what the
    uninterrupted (one-rank) run's did, which needs the Adam moments and step carried."""
    reshape_checkpoint(trained["tp2"], tmp_path / "pp2", 1, 2)
    make_dataset(tmp_path / "data" / "chars")  # the same documents the trained runs read
    model = dict(MODEL, save=None, load=str(tmp_path / "pp2"))
    layout = LAYOUTS["pp2"]
    train(write_config(tmp_path, "resume", vocab_file=str(bpe_tokenizer), **model, **layout))
    got, want = losses(tmp_path / "resume" / "logs"), losses(trained.logs("dense"))
    assert sorted(got) == [4, 5]
    for step in got:
        assert got[step] == pytest.approx(want[step], abs=2e-4), (step, got, want)


@pytest.fixture(scope="module")
def constant_data(tmp_path_factory):
    """A dataset whose every sample is `sample`, so the first loss is computable."""
    tmp = tmp_path_factory.mktemp("constant")
    doc = torch.randint(1, 320, (31,), generator=torch.Generator().manual_seed(3)).tolist() + [0]
    (tmp / "data").mkdir()
    write_constant_dataset(tmp / "data" / "chars", doc)
    return tmp, torch.tensor([doc + doc[:1]])


@pytest.mark.parametrize(
    "layout", [dict(num_gpus=1), dict(num_gpus=2, pipe_parallel_size=2)], ids=["tp1", "pp2"]
)
def test_finetune_at_another_layout_starts_from_the_consolidated_weights(
    trained, bpe_tokenizer, constant_data, layout
):
    tmp, sample = constant_data
    name = f"finetune_{layout.get('pipe_parallel_size', 1)}"
    model = dict(MODEL, train_iters=1, save=None, load=str(trained["tp2"]), finetune=True)
    train(write_config(tmp, name, vocab_file=str(bpe_tokenizer), **model, **layout))
    consolidated, _ = load_model(trained["tp2"])
    with torch.no_grad():
        expected = lm_loss(consolidated(sample[:, :-1]), sample[:, 1:]).item()
    assert losses(tmp / name / "logs")[1] == pytest.approx(expected, rel=1e-5)
    # The re-laid-out copy beside the checkpoint is gone.
    assert sorted(p.name for p in trained["tp2"].parent.iterdir()) == ["ckpt", "logs", "tb"]


def test_resuming_from_weights_only_is_refused(trained, bpe_tokenizer, tmp_path):
    reshape_checkpoint(trained["tp2"], tmp_path / "weights", 1, 1, weights_only=True)
    (tmp_path / "data").mkdir()
    write_constant_dataset(tmp_path / "data" / "chars", list(range(1, 32)) + [0])
    run = write_config(
        tmp_path,
        "resume",
        vocab_file=str(bpe_tokenizer),
        **dict(MODEL, save=None),
        num_gpus=1,
        load=str(tmp_path / "weights"),
    )
    env = child_env(DS_ACCELERATOR="cpu")
    r = subprocess.run(
        [sys.executable, str(ROOT / "deepy.py"), "train.py", str(run)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert r.returncode != 0
    assert (
        "holds weights only" in r.stderr + r.stdout
        and "set `finetune: true`" in r.stderr + r.stdout
    )
    assert "Traceback" not in r.stderr + r.stdout
