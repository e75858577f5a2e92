"""gpt-neox's config constructs and keys, in small files of our own (docs/compat.md has the table)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neox.config import ConfigError, derive, load_config, load_dict
from neox.config.ds_config import build_ds_config
from neox.config.unsupported import FEATURE_OFF_DEFAULTS
from tests.process_helpers import child_env

ROOT = Path(__file__).resolve().parents[2]

# gpt-neox's 125M.yml in miniature: a flow mapping with comments, trailing commas, True, and the
# hostfile it ships with, which names no real file.
FLOW_CONFIG = """# GPT-2 pretraining setup
{
   # parallelism settings
   "pipe_parallel_size": 1,
   "model_parallel_size": 1,
   "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
   "seq_length": 128, "max_position_embeddings": 128,
   "pos_emb": "rotary",
   "optimizer": {"type": "Adam", "params": {"lr": 0.0006, "betas": [0.9, 0.95], "eps": 1.0e-8,}},
   "zero_optimization": {"stage": 1, "cpu_offload": False,},
   "checkpoint_validation_with_forward_pass": False,
   "hostfile": "/mock_path",
   "launcher": "pdsh",
   "deepspeed_mpi": false,
}
"""

# The keys gpt-neox's NeoXArgs has that neox once called typos, at gpt-neox's defaults.
FORMER_TYPOS = {
    "fused_kernels_build_path": None,
    "serve_model_weights": False,
    "weight_server_port": 6000,
    "online_dataserver_ips": "localhost",
    "online_dataserver_ports": 10000,
    "wandb_run_name": None,
    "peak_theoretical_tflops": None,
    "gradient_noise_scale_n_batches": 5,
    "gradient_noise_scale_cpu_offload": False,
    "z_loss": 0.0,
    "fp32_reinforce": True,
    "kl_impl": "mse",
    "kl_div_beta": 0.1,
    "reinforce_leave_one_out": False,
    "scheduler": None,
    "tensorboard": None,
    "wandb": None,
}


def deepy(*args, cwd=ROOT):
    env = child_env(DS_ACCELERATOR="cpu")
    return subprocess.run(
        [sys.executable, str(ROOT / "deepy.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def test_flow_mapping_with_mock_hostfile_dry_runs_locally(tmp_path):
    (tmp_path / "125M.yml").write_text(FLOW_CONFIG)
    r = deepy("train.py", "-d", tmp_path, "125M", "--dry-run")  # a name without .yml
    assert r.returncode == 0, r.stderr
    assert "hostfile /mock_path does not exist: running on this machine only" in r.stderr
    assert "-m neox.launcher.agent --node_rank=0 --nodes=" in r.stdout  # one node, this machine
    assert "\nssh " not in r.stdout


def test_feature_keys_at_gpt_neox_defaults_are_accepted():
    cfg = load_dict({**FEATURE_OFF_DEFAULTS, **FORMER_TYPOS, "moe_num_experts": 1})
    assert cfg.model.num_layers == 2


@pytest.mark.parametrize(
    "key,value,feature",
    [
        ("moe_use_residual", True, "residual MoE"),
        ("mup_width_scale", 4, "muP"),
        ("dpo_beta", 0.5, "DPO"),
        ("kl_div_beta", 0.2, "REINFORCE"),
        ("gradient_noise_scale_n_batches", 10, "gradient noise scale"),
        ("attention_config", [[["gmlp"], "all"]], "gMLP"),
    ],
)
def test_feature_keys_off_their_default_are_refused_by_feature(key, value, feature):
    with pytest.raises(ConfigError, match=feature):
        load_dict({key: value})


def test_attention_config_all_repeats_over_every_layer():
    cfg = load_dict(
        {
            "num_layers": 4,
            "attention_config": [[["global", "local"], "all"]],
            "sliding_window_width": 8,
        }
    )
    assert cfg.model.shape.layer_types == ("global", "local") * 2


def test_values_gpt_neox_refuses_are_refused():
    for flat in ({"train_micro_batch_size_per_gpu": 0}, {"gradient_accumulation_steps": 0}):
        with pytest.raises(ConfigError, match="greater than 0"):
            load_dict(flat)
    # gpt-neox's validate_types: sections that would otherwise be read silently as something.
    with pytest.raises(ConfigError, match="fp16 section has no `enabled` key"):
        load_dict({"fp16": {"loss_scale": 0}})
    with pytest.raises(ConfigError, match="optimizer section lacks type"):
        load_dict({"optimizer": {"params": {"lr": 1e-3}}})
    with pytest.raises(ConfigError, match="optimizer section lacks params"):
        load_dict({"optimizer": {"type": "SGD"}})
    assert load_dict({}).optimizer.optimizer.type == "Adam"  # no section: the default


def test_optimizer_type_applies_without_an_optimizer_section():
    cfg = load_dict({"optimizer_type": "SGD"})
    assert derive(cfg, 1).optimizer_type == "sgd"
    both = load_dict({"optimizer_type": "sgd", "optimizer": {"type": "Adam", "params": {}}})
    with pytest.raises(ConfigError, match="contradicts optimizer.type"):
        derive(both, 1)


def test_dynamic_loss_scale_reaches_the_deepspeed_config():
    fp16 = {"fp16": {"enabled": True}}
    cfg = load_dict({**fp16, "dynamic_loss_scale": True})
    assert build_ds_config(cfg, derive(cfg, 1))["fp16"]["loss_scale"] == 0
    static = load_dict({**fp16, "dynamic_loss_scale": False})
    with pytest.raises(ConfigError, match="needs a static loss scale"):
        build_ds_config(static, derive(static, 1))


def test_the_same_key_twice_in_one_file_is_an_error(tmp_path):
    yml = tmp_path / "twice.yml"
    yml.write_text("num_layers: 2\nhidden_size: 64\nnum-layers: 4\n")
    with pytest.raises(ConfigError, match=r"'num_layers' appears twice \(lines 1 and 3"):
        load_config([yml])
    js = tmp_path / "twice.json"
    js.write_text('{"num_layers": 2, "num_layers": 4}')
    with pytest.raises(ConfigError, match="appears twice"):
        load_config([js])


def test_deepy_flags_of_gpt_neox_set_their_keys(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    flags = ["-H", hostfile, "--wandb_group", "g1", "--wandb_team", "t1", "--dry-run"]
    r = deepy("train.py", "configs/tiny.yml", *flags)
    assert r.returncode == 0, r.stderr
    assert f"hostfile: {hostfile}" in r.stdout and "wandb_group: g1" in r.stdout
    assert "--nodes=2 --devices=0,1 " in r.stdout  # the hostfile's slots=2
    assert "wandb_team: t1" in r.stdout


def test_git_hash_is_filled_in_from_the_checkout():
    r = deepy("train.py", "configs/tiny.yml", "--dry-run")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"git_hash: {commit.stdout.strip()}" in r.stdout


GPT_NEOX = os.environ.get("NEOX_GPT_NEOX_CHECKOUT", "")


@pytest.mark.skipif(
    not (Path(GPT_NEOX) / "configs").is_dir(),
    reason="set NEOX_GPT_NEOX_CHECKOUT to a gpt-neox checkout to dry-run its 59 configs",
)
def test_every_gpt_neox_config_passes_or_is_refused_by_feature(tmp_path):
    out = tmp_path / "table.md"
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/gpt_neox_compat.py"), GPT_NEOX, "--output", out],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert r.returncode == 0, out.read_text() if out.exists() else r.stderr
    assert "0 fails" in out.read_text().splitlines()[0]


@pytest.mark.parametrize(
    "flat,message",
    [
        ({"min_lr": 0.1, "lr": 0.01}, "min_lr=0.1 exceeds the peak learning rate 0.01"),
    ],
)
def test_combinations_gpt_neox_refuses(flat, message):
    with pytest.raises(ConfigError, match=message):
        derive(load_dict(flat), 1)
