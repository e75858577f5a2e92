"""Directories built by staged_directory (exports, reshaped checkpoints) get the modes the
user's umask gives a plain mkdir and open, not mkdtemp's 0700 or a writer's 0600."""

import os
import stat

import pytest

from neox.checkpoint.writer import write_checkpoint
from neox.config import load_dict
from neox.hf.export import export_to_hf
from neox.model import build_model
from tests.checkpoint.test_trust import MODEL


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_an_export_respects_the_umask(tmp_path, umask):
    cfg = load_dict(MODEL)
    write_checkpoint(build_model(cfg.model, 512).state_dict(), cfg, tmp_path / "ckpt", 3)
    old = os.umask(umask)
    try:
        export_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    finally:
        os.umask(old)
    out = tmp_path / "hf"
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    files = list(out.iterdir())
    assert "model.safetensors" in {p.name for p in files}  # safetensors writes 0600 itself
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
