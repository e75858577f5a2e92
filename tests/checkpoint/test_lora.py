"""LoRA runs on 2 CPU ranks: adapter-only checkpoints that name their base, exact resume, and
generate/eval/export reading the base through that reference."""

import json
import shutil

import pytest
import torch

from neox.checkpoint.adapter import REFERENCE_FILE, manifest_sha256
from neox.checkpoint.consolidate import load_model, load_model_state
from neox.checkpoint.trust import load_file
from tests.train_helpers import losses, make_dataset, train, write_config

pytestmark = pytest.mark.slow

LORA = dict(lora_rank=4, lora_alpha=8.0, optimizer={"type": "Adam", "params": {"lr": 1.0e-2}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base trained 3 steps; LoRA on it for 6 steps, uninterrupted and stopped at 3 + resumed."""
    tmp = tmp_path_factory.mktemp("lora")
    make_dataset(tmp / "data" / "chars")
    train(write_config(tmp, "base", train_iters=3))
    base = str(tmp / "base" / "ckpt")
    train(write_config(tmp, "full", lora_base=base, **LORA))
    train(write_config(tmp, "part", lora_base=base, exit_interval=3, **LORA))
    shutil.copytree(tmp / "part" / "ckpt", tmp / "part3")
    r = train(write_config(tmp, "part", lora_base=base, **LORA))
    assert "resuming from" in r.stdout
    return tmp


def test_resumed_lora_run_logs_the_losses_of_an_uninterrupted_one(runs):
    full, part = losses(runs / "full" / "logs"), losses(runs / "part" / "logs")
    assert sorted(full) == sorted(part) == [1, 2, 3, 4, 5, 6]
    for step in full:
        assert part[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step


def test_checkpoint_holds_the_adapters_alone_and_names_its_base(runs):
    step = runs / "full" / "ckpt" / "global_step6"
    module = load_file(step / "mp_rank_00_model_states.pt")["module"]
    assert module and all(".lora_A." in k or ".lora_B." in k for k in module)
    # 2 layers x 4 targets x (A, B)
    assert len(module) == 16
    ref = json.loads((step / REFERENCE_FILE).read_text())
    base = runs / "base" / "ckpt" / "global_step3"
    assert ref["base"] == str(base.resolve())
    assert ref["manifest_sha256"] == manifest_sha256(base)
    # The optimizer (every rank's partition) holds exactly the adapters' elements.
    adapter_numel = sum(v.numel() for v in module.values())
    held = 0
    for path in sorted(step.glob("*optim_states.pt")):
        osd = load_file(path)["optimizer_state_dict"]
        held += sum(t.numel() for t in osd["single_partition_of_fp32_groups"])
        for state in osd["base_optimizer_state"]["state"].values():
            assert state["exp_avg"].numel() == state["exp_avg_sq"].numel()
    assert held == adapter_numel


def test_load_model_applies_the_adapter_onto_the_base(runs):
    _, base = load_model_state(runs / "base" / "ckpt")
    cfg, merged = load_model_state(runs / "full" / "ckpt")
    assert cfg.lora.lora_rank == 4 and merged.keys() == base.keys()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith(".weight") for k in changed)
    assert all(any(t in k for t in ("query_key_value", "dense")) for k in changed)
    model, _ = load_model(runs / "full" / "ckpt")
    assert not any(".lora_" in k for k in model.state_dict())


def test_a_changed_base_is_refused(runs):
    from neox.checkpoint.errors import CheckpointError
    from neox.checkpoint.manifest import MANIFEST

    manifest = runs / "base" / "ckpt" / "global_step3" / MANIFEST
    original = manifest.read_bytes()
    manifest.write_bytes(original + b"\n")  # any rewrite of the base changes its manifest
    try:
        with pytest.raises(CheckpointError, match="the base changed"):
            load_model_state(runs / "full" / "ckpt")
    finally:
        manifest.write_bytes(original)
