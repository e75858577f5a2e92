"""A checkpoint is never trusted blindly: a pickle payload is refused by every reader (the
marker file it would write never appears), a flipped byte is caught by the manifest's checksum,
and `latest`, the manifest and config.yml are parsed defensively, confined to the directory."""

import json
import os
from pathlib import Path

import pytest
import torch

from neox.checkpoint.consolidate import CheckpointError, load_model_state, resolve_checkpoint
from neox.checkpoint.find import checkpoint_problem, find_checkpoint
from neox.checkpoint.manifest import MANIFEST
from neox.checkpoint.trust import UntrustedCheckpointError, load_file
from neox.checkpoint.writer import write_checkpoint
from neox.config import ConfigError, load_dict
from neox.model import build_model

MODEL = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=32,
    max_position_embeddings=32,
    pos_emb="rotary",
    tokenizer_type="CharLevelTokenizer",
)


class Payload:
    """Unpickling it runs `touch marker`: what a planted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A pp=1 checkpoint (save directory) as neox writes it, with its manifest."""
    cfg = load_dict(MODEL)
    sd = build_model(cfg.model, 256, device="cpu").state_dict()
    write_checkpoint(sd, cfg, tmp_path / "ckpt", iteration=3)
    return tmp_path / "ckpt"


def plant(tag_dir: Path, marker: Path, name: str = "mp_rank_00_model_states.pt") -> Path:
    """Add a payload to the torch file `name`, keeping its manifest entry up to date (as an
    attacker who can write the directory would)."""
    from neox.checkpoint.manifest import read_manifest, write_manifest

    path = tag_dir / name
    state = torch.load(path, weights_only=False)
    state["extra"] = Payload(marker)
    torch.save(state, path)
    manifest, _ = read_manifest(tag_dir)
    write_manifest(tag_dir, manifest["iteration"], manifest["padded_vocab_size"])
    return path


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor: the zip still reads
    path.write_bytes(bytes(data))


def test_a_payload_is_refused_by_every_reader(checkpoint, tmp_path):
    marker = tmp_path / "MARKER"
    path = plant(checkpoint / "global_step3", marker)
    with pytest.raises(UntrustedCheckpointError, match=r"GLOBAL posix.system.*--trust-checkpoint"):
        load_file(path)
    with pytest.raises(UntrustedCheckpointError, match="trust_checkpoint_code: true"):
        load_model_state(checkpoint)

    from neox.checkpoint.relayout import reshape_checkpoint

    with pytest.raises(UntrustedCheckpointError):
        reshape_checkpoint(checkpoint, tmp_path / "reshaped", 1, 2)
    assert not (tmp_path / "reshaped").exists()

    from tools import convert_to_hf
    from tools import reshape_checkpoint as reshape_tool

    for main, extra in ((convert_to_hf.main, []), (reshape_tool.main, ["--tp", "1"])):
        out = ["--output_dir", str(tmp_path / "out")]
        with pytest.raises(SystemExit, match="--trust-checkpoint"):
            main(["--input_dir", str(checkpoint), *out, *extra])

    from neox.inference.evaluation import load_eval_model
    from neox.inference.loading import load_state_dict

    with pytest.raises(ConfigError, match="weights-only"):
        load_state_dict(load_dict({**MODEL, "load": str(checkpoint)}))
    with pytest.raises(CheckpointError, match="weights-only"):
        load_eval_model(str(checkpoint), None, torch.device("cpu"), torch.float32)
    assert not marker.exists()
    # The opt-in loads it fully, and the payload runs: the refusal above was real.
    load_state_dict(load_dict({**MODEL, "load": str(checkpoint), "trust_checkpoint_code": True}))
    assert marker.exists()


def test_the_files_neox_writes_load_weights_only(checkpoint):
    cfg, sd = load_model_state(checkpoint)
    assert sd["embed_in.weight"].shape == (256, 32)
    manifest = json.loads((checkpoint / "global_step3" / MANIFEST).read_text())
    assert set(manifest["checksums"]) == set(manifest["files"])
    assert all(v.startswith("sha256:") for v in manifest["checksums"].values())


def test_a_flipped_byte_is_a_clear_error_for_the_tools(checkpoint):
    path = checkpoint / "global_step3" / "mp_rank_00_model_states.pt"
    flip_byte(path)
    with pytest.raises(CheckpointError, match=rf"{path} is corrupt: its content differs"):
        load_model_state(checkpoint)
    assert checkpoint_problem(checkpoint / "global_step3") is None  # sizes: a quick look
    assert "is corrupt" in checkpoint_problem(checkpoint / "global_step3", verify=True)


def test_a_garbled_config_is_a_clear_error(checkpoint):
    tag_dir = checkpoint / "global_step3"
    (tag_dir / "config.yml").write_bytes(b"\x00\xff\xfe: [\n")
    with pytest.raises(CheckpointError, match=r"config.yml is 7 bytes"):
        load_model_state(checkpoint)
    (tag_dir / MANIFEST).unlink()  # no manifest to catch it: the config is still not trusted
    with pytest.raises(CheckpointError, match=r"config.yml is not a readable neox config"):
        load_model_state(checkpoint, allow_unverified=True)
    assert "config.yml is garbled" in checkpoint_problem(tag_dir)


@pytest.mark.parametrize(
    "content", [b"\x89PNG\r\n\x1a\n\x00\xff", b"/etc", b"../elsewhere/global_step3", b"a\nb"]
)
def test_garbage_in_latest_is_never_followed(checkpoint, tmp_path, content):
    (tmp_path / "elsewhere" / "global_step3").mkdir(parents=True)
    (checkpoint / "latest").write_bytes(content)
    r = find_checkpoint(str(checkpoint))
    assert r.tag == "global_step3"  # the newest complete one, inside `load`
    [note] = r.report()
    assert note.startswith(f"ignoring {checkpoint / 'latest'}")
    with pytest.raises(CheckpointError, match=r"ignoring .*latest.*pass an iteration"):
        resolve_checkpoint(checkpoint)


def test_a_manifest_naming_files_outside_the_directory_is_unreadable(checkpoint):
    manifest = checkpoint / "global_step3" / MANIFEST
    doc = json.loads(manifest.read_text())
    doc["files"]["../../etc/passwd"] = 10
    manifest.write_text(json.dumps(doc))
    assert "is unreadable" in checkpoint_problem(checkpoint / "global_step3")


def test_a_checkpoint_that_lost_its_manifest_is_fallen_back_from(checkpoint):
    import shutil

    shutil.copytree(checkpoint / "global_step3", checkpoint / "global_step6")
    (checkpoint / "latest").write_text("global_step6")
    (checkpoint / "global_step6" / MANIFEST).unlink()
    r = find_checkpoint(str(checkpoint))
    assert r.tag == "global_step3"
    [(tag, reason)] = r.skipped
    assert tag == "global_step6" and "lost its manifest.json" in reason


def test_a_symbolic_link_out_of_the_checkpoint_is_refused(checkpoint, tmp_path):
    """Issue 33 (1): a `zero` folder linked to a folder outside the checkpoint held a payload
    that DeepSpeed's universal loader unpickled: rglob does not descend into a linked folder,
    and the manifest did not list it. A checkpoint is a closed set of files."""
    from neox.checkpoint.io import verify_checkpoint

    marker = tmp_path / "MARKER"
    outside = tmp_path / "outside" / "embed_in.weight"
    outside.mkdir(parents=True)
    torch.save({"param": Payload(marker)}, outside / "fp32.pt")
    step = checkpoint / "global_step3"
    (step / "zero").symlink_to(tmp_path / "outside")
    problem = verify_checkpoint(step, trust=False)
    assert problem is not None and f"{step / 'zero'} is a symbolic link" in problem
    r = find_checkpoint(str(checkpoint))
    assert r.tag is None and "is a symbolic link" in r.skipped[0][1]
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        load_model_state(checkpoint)
    # A file the manifest does not list (added after the save) is refused the same way.
    (step / "zero").unlink()
    torch.save({"param": Payload(marker)}, step / "extra.pt")
    assert f"{step / 'extra.pt'} is not listed in" in (verify_checkpoint(step, trust=False) or "")
    assert not marker.exists()


def test_deepspeeds_own_torch_loads_go_through_the_safe_loader(checkpoint, tmp_path):
    """Issue 33 (1): DeepSpeed's universal-checkpoint loader calls torch.load(weights_only=False)
    itself, past its checkpoint engine. Within a DeepSpeed load every torch.load is weights-only
    and confined to the checkpoint directory."""
    from types import SimpleNamespace

    from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state

    from neox.checkpoint.trust import deepspeed_loads_safely

    marker = tmp_path / "MARKER"
    step = checkpoint / "global_step3"
    inside = step / "zero" / "embed_in.weight"
    inside.mkdir(parents=True)
    torch.save({"param": Payload(marker)}, inside / "fp32.pt")
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save({"param": torch.zeros(2)}, outside / "fp32.pt")
    (step / "zero" / "linked").symlink_to(outside)
    param = SimpleNamespace(_hp_mapping=SimpleNamespace())  # what DeepSpeed binds it to
    with deepspeed_loads_safely(SimpleNamespace(), trust=False, root=step):
        with pytest.raises(UntrustedCheckpointError, match="GLOBAL posix.system"):
            load_hp_checkpoint_state(param, str(inside), 0, 1)
        for folder in (outside, step / "zero" / "linked", step / "zero" / ".." / ".." / ".."):
            with pytest.raises(CheckpointError, match="lies outside the checkpoint"):
                torch.load(folder / "fp32.pt", weights_only=False)
    assert torch.load is torch.serialization.load  # put back after the block
    assert not marker.exists()


def test_a_neox_checkpoint_that_lost_its_manifest_is_refused_unless_allowed(checkpoint, tmp_path):
    """Issue 33 (4): deleting every manifest turned integrity checking off; resume trained on
    corrupt values and convert_to_hf exported them. Now refused, naming the opt-in."""
    from tools import convert_to_hf

    step = checkpoint / "global_step3"
    (step / MANIFEST).unlink()
    flip_byte(step / "mp_rank_00_model_states.pt")
    r = find_checkpoint(str(checkpoint))
    assert r.tag is None
    [(tag, reason)] = r.skipped
    assert "lost its manifest.json" in reason and "allow_unverified_checkpoint: true" in reason
    with pytest.raises(CheckpointError, match="lost its manifest.json.*--allow-unverified"):
        load_model_state(checkpoint)
    out = tmp_path / "hf"
    with pytest.raises(SystemExit, match="allow_unverified_checkpoint"):
        convert_to_hf.main(["--input_dir", str(checkpoint), "--output_dir", str(out)])
    assert not out.exists()
    allowed = find_checkpoint(str(checkpoint), allow_unverified=True)
    assert allowed.tag == "global_step3"
    [note] = allowed.report()
    assert "written by neox" in note and "loaded unverified" in note


def test_a_foreign_checkpoint_without_a_manifest_loads_with_a_warning(checkpoint):
    """A checkpoint of gpt-neox or DeepSpeed (no config.yml, no manifest) is used, unverified."""
    step = checkpoint / "global_step3"
    (step / MANIFEST).unlink()
    (step / "config.yml").unlink()
    r = find_checkpoint(str(checkpoint))
    assert r.tag == "global_step3"
    [note] = r.report()
    assert "not written by neox" in note and "loaded unverified" in note
