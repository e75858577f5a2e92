"""A safetensors file written and checksummed in one pass: the manifest's sha256 of the file is
computed on the bytes as they are written, so the save never reads the file back to hash it.

Written by hand because safetensors' writer (`save_file`) takes a path or returns bytes, no
stream to hash as it goes: the checksum then re-read the whole file (at Pythia-1.4B one rank's
17 GB file, ~10 s of a 25 s save at ~1.7 GB/s). The format is small and fixed
(https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON header
(per tensor its dtype, shape and [begin, end) byte offsets into the data; `__metadata__`
optional) padded with spaces to a multiple of 8, then the tensors' bytes back to back.
`safetensors.safe_open` and `safetensors.torch.load_file` read what this writes.

Each tensor's bytes are written from its own memory (no copy), in chunks that a second thread
hashes while they are written: file writes and hashlib both release the GIL, so the hash
overlaps the write instead of adding to it. The write and the hash read the same memory at
slightly different times, so the tensors must not change until it returns: a save writes host
copies that no step touches (neox/checkpoint/host_staging.py). Nothing here fsyncs: the save
fsyncs the whole checkpoint once at publish (neox.checkpoint.atomic.fsync_tree).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from pathlib import Path
from typing import Optional

import torch

from neox.checkpoint.manifest import ALGORITHM

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
}
"""torch dtype -> the safetensors format's name for it."""

CHUNK_BYTES = 64 << 20
"""Bytes per write (and per hash update): large enough that the per-call cost vanishes, small
enough that the hash thread trails the write by little. Linux writes at most 0x7FFFF000 bytes in
one call; the write loop takes any shorter write too."""


def save_hashed(
    tensors: dict[str, torch.Tensor],
    path: Path,
    metadata: Optional[dict[str, str]] = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> str:
    """Write `tensors` (CPU, contiguous) to `path` as safetensors; its checksum as
    neox.checkpoint.manifest.file_digest gives it (`sha256:<hex>`)."""
    header, data = _layout(tensors, metadata)
    hasher = _Hasher()
    try:
        with open(path, "wb") as f:
            fd = f.fileno()
            for chunk in _chunks([header, *data], chunk_bytes):
                hasher.feed(chunk)
                _write_all(fd, chunk)
    finally:
        hexdigest = hasher.finish()
    return f"{ALGORITHM}:{hexdigest}"


def _layout(tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]]):
    """(header bytes, each tensor's bytes in file order). Larger elements first, then by name,
    as safetensors orders them: every tensor starts aligned to its element size."""
    head: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata maps strings to strings")
        head["__metadata__"] = metadata
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    data, offset = [], 0
    for name, t in order:
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: safetensors stores no {t.dtype}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name}: only contiguous CPU tensors are written (call .cpu())")
        size = t.numel() * t.element_size()
        head[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        if size:
            data.append(_bytes(t))
        offset += size
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, data


def _bytes(t: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (no copy); the format is little-endian, as are the CPUs
    torch runs on."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _chunks(buffers, chunk_bytes: int):
    for buf in buffers:
        view = memoryview(buf)
        for start in range(0, len(view), chunk_bytes):
            yield view[start : start + chunk_bytes]


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        chunk = chunk[os.write(fd, chunk) :]


class _Hasher:
    """sha256 of the chunks fed to it, in order, computed in a thread of its own."""

    def __init__(self) -> None:
        self._hash = hashlib.new(ALGORITHM)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._hash.update(chunk)

    def feed(self, chunk: memoryview) -> None:
        self._queue.put(chunk)

    def finish(self) -> str:
        self._queue.put(None)
        self._thread.join()
        return self._hash.hexdigest()
