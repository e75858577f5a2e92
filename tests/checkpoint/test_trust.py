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


def plant(tag_dir: Path, marker: Path) -> Path:
    """Add a payload to the model file, keeping its manifest entry up to date (as an attacker
    who can write the directory would)."""
    from neox.checkpoint.manifest import read_manifest, write_manifest

    path = tag_dir / "mp_rank_00_model_states.pt"
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
        load_model_state(checkpoint)
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
