"""A safetensors file written and checksummed in one pass (issue 35): safetensors reads it back
bit for bit, and the checksum returned is the manifest's checksum of the file on disk."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from neox.checkpoint import hashed_write
from neox.checkpoint.hashed_write import save_hashed
from neox.checkpoint.manifest import file_digest


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32/scalar": torch.tensor(1.5),
        "fp32/empty": torch.zeros(0, 3),
        "fp32/big": torch.randn(257, 33, generator=g),  # several 1000-byte chunks
        "bf16/w": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "bf16/empty": torch.zeros(4, 0, dtype=torch.bfloat16),
        "int64/step": torch.tensor(3, dtype=torch.int64),
        "int64/ids": torch.randint(-(2**62), 2**62, (11,), generator=g),
        "bool/mask": torch.tensor([True, False, True]),
        "f8/x": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
    }


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (bit equality, NaNs and -0.0 included)."""
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("chunk_bytes", [1000, 7, hashed_write.CHUNK_BYTES])
def test_the_file_reads_back_bit_equal_and_its_digest_is_the_manifests(tmp_path, chunk_bytes):
    saved = tensors()
    path = tmp_path / "rank.safetensors"
    digest = save_hashed(saved, path, {"format": "pt"}, chunk_bytes=chunk_bytes)
    assert digest == file_digest(path)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(saved) and f.metadata() == {"format": "pt"}
        for name, t in saved.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(raw(got), raw(t)), name
            if t.numel() > 1:  # slices read from the offsets recorded
                assert torch.equal(raw(f.get_slice(name)[1:]), raw(t[1:]))
    loaded = load_file(path)
    assert all(torch.equal(raw(loaded[n]), raw(t)) for n, t in saved.items())


def test_the_header_follows_the_format(tmp_path):
    path = tmp_path / "x.safetensors"
    save_hashed({"b": torch.zeros(3, dtype=torch.int8), "a": torch.ones(2)}, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and len(raw) == 8 + n + 3 + 8
    header = json.loads(raw[8 : 8 + n])
    assert "__metadata__" not in header
    # The larger element first: every tensor starts aligned to its element size.
    assert header["a"] == {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    assert header["b"] == {"dtype": "I8", "shape": [3], "data_offsets": [8, 11]}


def test_a_write_the_kernel_cuts_short_is_completed(tmp_path, monkeypatch):
    """Linux writes at most 0x7FFFF000 bytes a call (and a signal can cut any write short)."""
    real = hashed_write.os.write
    calls = []

    def short(fd, data):
        calls.append(len(data))
        return real(fd, data[:3])

    monkeypatch.setattr(hashed_write.os, "write", short)
    saved = {"w": torch.randn(40)}
    path = tmp_path / "x.safetensors"
    digest = save_hashed(saved, path, chunk_bytes=64)
    assert len(calls) > len(saved["w"]) * 4 // 64  # more calls than chunks
    assert digest == file_digest(path) and torch.equal(load_file(path)["w"], saved["w"])


def test_what_it_cannot_write_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="w: only contiguous CPU tensors"):
        save_hashed({"w": torch.randn(4, 3).t()}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="metadata maps strings to strings"):
        save_hashed({"w": torch.zeros(1)}, tmp_path / "x.safetensors", {"step": 3})
