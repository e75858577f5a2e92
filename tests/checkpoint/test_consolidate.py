"""Reading checkpoints back: every layout consolidates to the dense run's model; bad paths fail
with one error that says what to pass."""

import shutil

import pytest
import torch
import yaml

from neox.checkpoint.consolidate import (
    CheckpointError,
    load_model,
    load_model_state,
    resolve_checkpoint,
)
from neox.checkpoint.manifest import write_manifest
from neox.model import build_model
from tests.layout_helpers import LAYOUTS


def batch() -> torch.Tensor:
    return torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "dense"])
def test_every_layout_consolidates_to_the_dense_model(trained, layout):
    dense, _ = load_model(trained["dense"])
    model, cfg = load_model(trained[layout])
    assert cfg.checkpoint.save == str(trained[layout])
    with torch.no_grad():
        expected, got = dense(batch()), model(batch())
    # fp32; the layouts reduce in another order (their losses agree to rel 1e-5).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Training moved the weights away from their initial values.
    init = build_model(cfg.model, 512, cfg.training.seed)
    assert not torch.equal(model.embed_out.weight, init.embed_out.weight)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_dict_has_exactly_the_plain_model_names_and_shapes(trained, layout):
    cfg, sd = load_model_state(trained[layout])
    plain = build_model(cfg.model, 512, device="meta").state_dict()
    assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in plain.items()}
    assert all(v.dtype == torch.float32 for v in sd.values())


@pytest.mark.slow
def test_iteration_and_tag_directory_select_the_same_checkpoint(trained):
    save = trained["tp2"]
    assert resolve_checkpoint(save) == save / "global_step3"
    assert resolve_checkpoint(save, iteration=3) == save / "global_step3"
    assert resolve_checkpoint(save / "global_step3") == save / "global_step3"
    with pytest.raises(
        CheckpointError, match=r"no checkpoint for iteration 7 \(found: global_step3"
    ):
        resolve_checkpoint(save, iteration=7)


@pytest.mark.slow
def test_incomplete_or_edited_checkpoint_is_refused(trained, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(trained["tp2"], copy)
    for name in ("rank_00001.safetensors", "rank_00001.json"):
        (copy / "global_step3" / "state" / name).unlink()
    with pytest.raises(CheckpointError, match=r"rank_00001.(json|safetensors) is missing"):
        load_model_state(copy)  # the manifest names it
    (copy / "global_step3" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"holds 1 of the 2 tensor-parallel pieces"):
        load_model_state(copy, allow_unverified=True)

    shutil.rmtree(copy)
    shutil.copytree(trained["dense"], copy)
    saved = copy / "global_step3" / "config.yml"
    flat = yaml.safe_load(saved.read_text())
    saved.write_text(yaml.safe_dump(dict(flat, hidden_size=64)))
    with pytest.raises(CheckpointError, match=r"config.yml is (\d+ bytes|corrupt)"):
        load_model_state(copy)  # the manifest's size or checksum
    (copy / "global_step3" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="do not fit the model its config.yml describes"):
        load_model_state(copy, allow_unverified=True)


def fake_tag(directory, with_config=True):
    directory.mkdir(parents=True)
    (directory / "mp_rank_00_model_states.pt").touch()
    if with_config:
        (directory / "config.yml").write_text("{}\n")
        write_manifest(directory, 0, None)
    return directory


def test_missing_path_names_what_to_pass(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist; pass the directory a run saved to"):
        resolve_checkpoint(tmp_path / "nowhere")
    (tmp_path / "file.pt").touch()
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_checkpoint(tmp_path / "file.pt")


def test_directory_without_latest_lists_the_checkpoints_found(tmp_path):
    fake_tag(tmp_path / "global_step10")
    fake_tag(tmp_path / "global_step2")
    with pytest.raises(
        CheckpointError, match=r"no `latest` file \(found: global_step2, global_step10\)"
    ):
        resolve_checkpoint(tmp_path)
    assert resolve_checkpoint(tmp_path, iteration=10) == tmp_path / "global_step10"


def test_latest_naming_a_missing_directory(tmp_path):
    fake_tag(tmp_path / "global_step2")
    (tmp_path / "latest").write_text("global_step4")
    with pytest.raises(CheckpointError, match="names 'global_step4', which is not a directory"):
        resolve_checkpoint(tmp_path)


def test_checkpoint_without_config_is_refused(tmp_path):
    fake_tag(tmp_path / "global_step2", with_config=False)
    (tmp_path / "latest").write_text("global_step2")
    with pytest.raises(CheckpointError, match="has no config.yml"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not iteration 3"):
        resolve_checkpoint(tmp_path / "global_step2", iteration=3)


def test_empty_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no `latest` file .*holds no global_stepN"):
        resolve_checkpoint(tmp_path)
