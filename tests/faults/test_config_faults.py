"""Bad configs, files and command lines given to deepy.py: one clear message, exit 2, no traceback,
nothing launched or written. Each case: the fault, the promise, the assertion."""

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.train_helpers import make_dataset, run_deepy

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each case starts deepy.py or preprocess_data.py


@dataclass
class Fault:
    """A broken input to `deepy.py train.py tiny.yml <files>` and what deepy must say."""

    name: str
    promise: str
    files: dict[str, str | bytes]  # file name -> contents, written to tmp_path
    message: str  # expected on stderr
    args: list[str] = field(default_factory=list)
    dry_run: bool = False
    code: int = 2


def data_config(tmp_path: Path, **extra) -> str:
    flat = {
        "tokenizer_type": "CharLevelTokenizer",
        "data_path": str(tmp_path / "chars"),
        "log_dir": str(tmp_path / "logs"),
        "tensorboard_dir": str(tmp_path / "tb"),
        "save": str(tmp_path / "ckpt"),
        **extra,
    }
    return yaml.safe_dump(flat)


FAULTS = [
    Fault(
        "micro_batch_zero",
        "train_micro_batch_size_per_gpu: 0 is refused (gpt-neox refuses it), not turned into 1",
        {"bad.yml": "train_micro_batch_size_per_gpu: 0\n"},
        "train_micro_batch_size_per_gpu=0 must be greater than 0 (allowed: (0, 16777216])",
        dry_run=True,
    ),
    Fault(
        "batch_triple_off",
        "a batch triple that does not multiply out names the files that set its keys",
        {"bad.yml": "train_batch_size: 12\n"},
        "bad.yml, configs/tiny.yml: train_batch_size=12 != train_micro_batch_size_per_gpu=8 x "
        "gradient_accumulation_steps=1 x data-parallel size 1 = 8",
        dry_run=True,
    ),
    Fault(
        "key_twice",
        "the same key twice in one file names both lines instead of keeping the last",
        {"bad.yml": "hidden_size: 64\nseq_length: 64\nhidden-size: 128\n"},
        "key 'hidden_size' appears twice (lines 1 and 3",
        dry_run=True,
    ),
    Fault(
        "binary_config",
        "a binary file given as a config is named as not a text file",
        {"bad.yml": bytes(range(256)) * 4},
        "not a text file",
        dry_run=True,
    ),
    Fault(
        "vocab_of_another_tokenizer",
        "a vocab file of the wrong kind for tokenizer_type is named before launch",
        {"bad.yml": "tokenizer_type: HFTokenizer\nvocab_file: {tmp}/merges.txt\n"},
        "tokenizer_type=HFTokenizer cannot read vocab_file=",
    ),
    Fault(
        "idx_bad_magic",
        "a .idx with the wrong magic stops a real launch before any rank starts",
        {"bad.yml": "{data}"},
        "is not an mmap indexed dataset index (bad magic",
    ),
    Fault(
        "missing_script",
        "a missing entry script is an error even in a dry run",
        {},
        "entry script 'generate_nothing.py' does not exist",
        args=["generate_nothing.py"],
        dry_run=True,
    ),
    Fault(
        "unknown_feature_value",
        "a gpt-neox feature neox lacks is refused by name (at its default it is accepted)",
        {"bad.yml": "use_mup: true\n"},
        "use_mup=True asks for muP, which is not implemented in neox",
        dry_run=True,
    ),
    Fault(
        "save_dir_is_a_file",
        "a `save` path that cannot be a directory is named before launch",
        {"data.yml": "{data}", "bad.yml": "save: {tmp}/merges.txt/ckpt\n"},
        "merges.txt/ckpt' is inside ",
    ),
    Fault(
        "save_empty",
        "`save: ''` (gpt-neox reads it as unset: no checkpoint, no word) is refused by name",
        {"data.yml": "{data}", "bad.yml": "save: ''\n"},
        "save='' is an empty path, which would silently save no checkpoint; set save: null",
    ),
    Fault(
        "load_empty",
        "`load: ''` (it would silently start from scratch) is refused by name",
        {"bad.yml": "{data}load: ''\n"},
        "load='' is an empty path, which would silently start from scratch",
    ),
    Fault(
        "zero_section_deepspeed_refuses",
        "a zero_optimization value DeepSpeed's own config model refuses (offload to 'gpu') is "
        "refused before launch by that model, the key and value named (it failed on every rank)",
        {"bad.yml": "{data}zero_optimization:\n  stage: 1\n  offload_optimizer: {device: gpu}\n"},
        "zero_optimization.offload_optimizer.device='gpu': Input should be 'none', 'cpu' or "
        "'nvme' (DeepSpeed's DeepSpeedZeroConfig)",
    ),
    Fault(
        "memory_estimate_absurd",
        "a run estimated far over what each rank has (here 834 TiB) is refused, not left to "
        "fail on the ranks",
        {"bad.yml": "{data}hidden_size: 65536\nnum_attention_heads: 64\nnum_layers: 1024\n"},
        "TiB per rank is over 2x the",
    ),
    Fault(
        "split_leaves_valid_empty",
        "a split that gives the valid split no documents while the run evaluates is refused "
        "before launch (it was a traceback on every rank), the split and the fix named",
        {"bad.yml": "{data}split: '1000,1,0'\n"},
        "split='1000,1,0' gives the valid split no documents (train/valid/test get 60/0/0 of "
        "the 60 in data_path=",
    ),
    Fault(
        "split_leaves_train_empty",
        "a split that gives train no documents is refused before launch",
        {"bad.yml": "{data}split: '0,1,0'\n"},
        "gives the train split no documents",
    ),
    Fault(
        "yaml_alias_bomb",
        "a ~600-byte YAML alias bomb (1e9 values) is one line and exit 2 in a dry run, not "
        "gigabytes and a MemoryError (issue 33, defect 7)",
        {
            "bad.yml": "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9))
        },
        "bad.yml: its YAML aliases expand to more than 100,000 values",
        dry_run=True,
    ),
    Fault(
        "log_dir_unwritable",
        "a log_dir the ranks cannot create (sysfs refuses even root) is named before launch, not "
        "a traceback on every rank (issue 33, defect 8)",
        {"data.yml": "{data}", "bad.yml": "log_dir: /sys/neox_no_logs_here/logs\n"},
        "log_dir='/sys/neox_no_logs_here/logs': the directory cannot be written",
    ),
    Fault(
        "tensorboard_dir_is_a_file",
        "a tensorboard_dir naming a file is named before launch (issue 33, defect 8)",
        {"data.yml": "{data}", "bad.yml": "tensorboard_dir: {tmp}/merges.txt\n"},
        "merges.txt' is a file, not a directory; point tensorboard_dir at a directory",
    ),
    Fault(
        "lion_on_cpu_ranks",
        "Lion on CPU ranks (DeepSpeed's FusedLion has no CPU kernel) is named before launch "
        "(issue 33, defect 8)",
        {"bad.yml": "{data}optimizer: {type: Lion, params: {lr: 0.001}}\n"},
        "optimizer type lion steps with DeepSpeed's FusedLion, which has no CPU implementation",
    ),
    Fault(
        "local_attention_without_window",
        "`local` layers without sliding_window_width: one line and exit 2 in a dry run (it was a "
        "traceback there and in tools/estimate.py; issue 33, defect 8)",
        {"bad.yml": 'attention_config: [[["local"], 2]]\n'},
        "attention_config has `local` layers but sliding_window_width is unset",
        dry_run=True,
    ),
    Fault(
        "export_env_unset",
        "launcher.export_env naming a variable this shell lacks is named (it was a traceback)",
        {"bad.yml": "export_env: [NEOX_NOT_SET_ANYWHERE]\n"},
        "launcher.export_env names NEOX_NOT_SET_ANYWHERE, not set in this environment",
        dry_run=True,
    ),
]


def deepy_here(argv: list[str], monkeypatch, capsys, caplog) -> tuple[int, str, str]:
    """(exit status, stdout, stderr with the log) of deepy.main in this process: the faults
    are refused before anything starts (deepy.py's own process: the tests after these)."""
    import deepy

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with caplog.at_level(logging.INFO):  # deepy.py's own level: its `launching` line included
        code = deepy.main(argv)
    out, err = capsys.readouterr()
    return code, out, err + caplog.text


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_config_fault(fault: Fault, tmp_path, monkeypatch, capsys, caplog):
    make_dataset(tmp_path / "chars")
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\n")
    idx = tmp_path / "chars.idx"
    if fault.name == "idx_bad_magic":
        idx.write_bytes(b"NOTANIDX!" + idx.read_bytes()[9:])
    names = []
    for name, contents in fault.files.items():
        path = tmp_path / name
        if isinstance(contents, bytes):
            path.write_bytes(contents)
        else:
            text = contents.replace("{data}", data_config(tmp_path))
            path.write_text(text.replace("{tmp}", str(tmp_path)))
        names.append(str(path))
    if not names:
        (tmp_path / "ok.yml").write_text(data_config(tmp_path))
        names.append(str(tmp_path / "ok.yml"))
    script = fault.args[0] if fault.args else "train.py"
    argv = ["configs/tiny.yml", *names] + (["--dry-run"] if fault.dry_run else [])
    code, out, err = deepy_here([script, *argv], monkeypatch, capsys, caplog)
    assert code == fault.code, out[-2000:] + err[-2000:]
    assert fault.message in err, err
    assert "Traceback" not in err + out
    assert "# launch command" not in out and "launching" not in err
    # Nothing of a run was created: no logs, metrics, tensorboard files or save directory.
    assert not (tmp_path / "logs").exists() and not (tmp_path / "tb").exists()
    assert not (tmp_path / "ckpt").exists()


def test_foreign_vocab_in_a_dry_run_is_a_warning_not_a_traceback(tmp_path):
    """Fault: a vocab file of another tokenizer in a dry run. Promise: a warning, exit 0."""
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\n")
    bad = tmp_path / "bad.yml"
    bad.write_text(f"tokenizer_type: HFTokenizer\nvocab_file: {tmp_path}/merges.txt\n")
    r = run_deepy("train.py", "configs/tiny.yml", bad, "--dry-run", check=False)
    assert r.returncode == 0, r.stderr
    assert "a real launch would stop here" in r.stderr and "cannot read vocab_file" in r.stderr
    assert "Traceback" not in r.stderr


def test_master_addr_without_hostfile_is_reported(tmp_path, monkeypatch, capsys, caplog):
    """Fault: master_addr with no hostfile. Promise: a warning that it is unused, not silence."""
    cfg = tmp_path / "addr.yml"
    cfg.write_text("master_addr: 10.1.2.3\n")
    argv = ["train.py", "configs/tiny.yml", str(cfg), "--dry-run"]
    code, _, err = deepy_here(argv, monkeypatch, capsys, caplog)
    assert code == 0, err
    assert "master_addr=10.1.2.3 is not used" in err


def test_bad_export_env_name_is_a_config_error():
    """Fault: export_env names something that is not a variable name. Promise: a config error."""
    from neox.config import ConfigError, load_dict

    with pytest.raises(ConfigError, match="not environment variable names"):
        load_dict({"export_env": ["OK_NAME", "X; rm -rf /"]})


def test_fp16_on_cpu_ranks_is_refused_before_launch(tmp_path, monkeypatch, capsys, caplog):
    """Fault: fp16 (every stock gpt-neox config) on CPU ranks, which DeepSpeed's CPU accelerator
    refuses on every rank. Promise: before launch, naming the fix; a warning in a dry run."""
    import torch

    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        pytest.skip("this CPU has fp16 (AMX-FP16): DeepSpeed runs fp16 on it")
    make_dataset(tmp_path / "chars")
    bad = tmp_path / "bad.yml"
    bad.write_text(data_config(tmp_path) + "fp16: {enabled: true}\n")
    message = f"{bad}: precision fp16 is not supported by DeepSpeed on this machine's CPU"
    r = run_deepy("train.py", "configs/tiny.yml", bad, check=False)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "configs/cpu.yml" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()
    # The dry runs in this process (the refusal above: deepy.py's own).
    dry = ["train.py", "configs/tiny.yml", str(bad), "--dry-run"]
    code, _, err = deepy_here(dry, monkeypatch, capsys, caplog)
    assert code == 0 and message in err, err
    # The fix the message names works: configs/cpu.yml layered last turns fp16 off.
    caplog.clear()
    code, _, err = deepy_here(
        [*dry[:3], "configs/cpu.yml", "--dry-run"], monkeypatch, capsys, caplog
    )
    assert code == 0 and "precision fp16" not in err, err


def test_skip_memory_check_lets_an_oversized_estimate_through(
    tmp_path, monkeypatch, capsys, caplog
):
    """Fault: an estimate over the machine's memory that the user means to run. Promise: the
    override key named in the refusal turns the refusal off."""
    make_dataset(tmp_path / "chars")
    big = tmp_path / "big.yml"
    big.write_text(
        data_config(tmp_path, hidden_size=65536, num_attention_heads=64, num_layers=1024)
    )
    dry = ["train.py", "configs/tiny.yml", str(big), "--dry-run"]
    code, _, err = deepy_here(dry, monkeypatch, capsys, caplog)
    assert code == 0 and "set skip_memory_check: true" in err, err
    (tmp_path / "skip.yml").write_text("skip_memory_check: true\n")
    caplog.clear()
    code, _, err = deepy_here(
        [*dry[:3], str(tmp_path / "skip.yml"), "--dry-run"], monkeypatch, capsys, caplog
    )
    assert code == 0 and "per rank is over" not in err, err


@pytest.mark.parametrize(
    "module, keys, message",
    [
        ("wandb", {"use_wandb": True}, "use_wandb=True needs the wandb package"),
        (
            "sentencepiece",
            {"tokenizer_type": "SPMTokenizer", "vocab_file": "{tmp}/merges.txt"},
            "tokenizer_type=SPMTokenizer needs the sentencepiece package",
        ),
    ],
)
def test_optional_package_a_key_needs_is_named_before_launch(
    module, keys, message, tmp_path, monkeypatch, capsys
):
    """Fault: a key needing an optional package this machine lacks (the ranks would fail on its
    import). Promise: before launch, the key, the package and `pip install 'neox[...]'`."""
    import deepy

    make_dataset(tmp_path / "chars")
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\n")
    keys = {k: str(v).replace("{tmp}", str(tmp_path)) for k, v in keys.items()}
    bad = tmp_path / "bad.yml"
    bad.write_text(data_config(tmp_path, **keys))
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: find_spec says None
    assert deepy.main(["train.py", "configs/tiny.yml", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: {message}" in err and "pip install 'neox[" in err, err
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "fault, keys, message",
    [
        (
            "train_iters_below_the_checkpoint",
            {"train_iters": 20},
            "train_iters=20 is below the step of the checkpoint it resumes, 30",
        ),
        ("weights_only_without_finetune", {}, "holds weights only"),
        (
            "another_rotary_base",
            {"rotary_emb_base": 500000},
            "rotary_emb_base 10000 (checkpoint) vs 500000 (config)",
        ),
    ],
)
def test_resume_mistakes_stop_a_real_launch(fault, keys, message, tmp_path):
    """Faults: resuming past the run's end (it re-saved the step silently), weights only without
    finetune, another rotary base (accepted silently). Promise: before launch, named."""
    import torch

    from neox.checkpoint.find import WEIGHTS_ONLY
    from neox.checkpoint.manifest import write_manifest
    from neox.config import load_config, write_config

    make_dataset(tmp_path / "chars")
    run = tmp_path / "run.yml"
    run.write_text(data_config(tmp_path, load=str(tmp_path / "ckpt")))
    step = tmp_path / "ckpt" / "global_step30"
    step.mkdir(parents=True)
    torch.save({"w": torch.zeros(4)}, step / "mp_rank_00_model_states.pt")
    write_config(load_config([ROOT / "configs" / "tiny.yml", run]).config, step / "config.yml")
    (tmp_path / "ckpt" / "latest").write_text("global_step30")
    if fault == "weights_only_without_finetune":
        (step / WEIGHTS_ONLY).write_text("weights only\n")
    write_manifest(step, 30, None)
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(keys))
    r = run_deepy("train.py", "configs/tiny.yml", run, bad, check=False)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "logs").exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before
