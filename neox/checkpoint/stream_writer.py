"""Write the DeepSpeed files of a checkpoint one tensor at a time, never holding the model.

A tensor-parallel rank's module file (see ds_files.py) holds that rank's whole model, and
torch.save needs every tensor in memory at once. So each file is first laid out by torch itself
(`torch.serialization.skip_data`: the pickle and the zip records, with the tensor bytes left
empty), its tensors' byte offsets read back from a metadata-only load, and then each tensor is
written into its place as the converter produces it. The files are the ones writer.py writes
(same names, same dicts), and torch.load reads them as any other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from neox.checkpoint.consolidate import StateDict, partition_dim
from neox.checkpoint.ds_files import layer_file, mp_file
from neox.checkpoint.find import WEIGHTS_ONLY, tag_for
from neox.checkpoint.manifest import write_manifest
from neox.checkpoint.writer import _engine_state, pipeline_layers
from neox.config import NeoXConfig, write_config
from neox.parallel.layers import shard

# Linux writes at most this many bytes per write call.
MAX_WRITE = 0x7FFFF000


def _shard_shape(shape: torch.Size, dim: int | None, tp: int) -> list[int]:
    out = list(shape)
    if dim is not None and tp > 1:
        if out[dim] % tp:
            raise ValueError(f"dim {dim} of shape {tuple(shape)} is not divisible by tp={tp}")
        out[dim] //= tp
    return out


def _fake(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(shape, dtype=dtype)


def _layout_file(path: Path, obj: Any) -> dict[int, int]:
    """torch.save `obj` (fake tensors) without data; returns id(fake tensor) -> byte offset."""
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(obj, path)
    loaded = torch.load(path, map_location="meta", weights_only=True)

    def tensors(o: Any) -> list[torch.Tensor]:
        if isinstance(o, torch.Tensor):
            return [o]
        if isinstance(o, dict):
            return [t for v in o.values() for t in tensors(v)]
        return []

    # Pickling walks dicts in order, so the saved and loaded tensors pair up by position.
    saved, back = tensors(obj), tensors(loaded)
    assert len(saved) == len(back)
    return {
        id(s): b.untyped_storage()._checkpoint_offset + b.storage_offset() * b.element_size()
        for s, b in zip(saved, back)
    }


def _pwrite(fd: int, tensor: torch.Tensor, offset: int) -> None:
    data = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + MAX_WRITE], offset + done)


class StreamingCheckpoint:
    """The files of global_step{iteration} for cfg's TP/PP, filled by `write` tensor by tensor.

    `layout` maps every full (unsharded) plain name to a tensor of its final shape and dtype
    (meta is fine); `finish` refuses unless every name was written once.
    """

    def __init__(
        self, cfg: NeoXConfig, save_dir: Path, layout: StateDict, iteration: int = 0
    ) -> None:
        self.cfg, self.save_dir, self.iteration = cfg, Path(save_dir), iteration
        self.tag_dir = self.save_dir / tag_for(iteration)
        self.tag_dir.mkdir(parents=True, exist_ok=True)
        self.tp, self.pp = cfg.parallel.model_parallel_size, cfg.parallel.pp
        self.layout = layout
        # (name, tp rank) -> (file, byte offset)
        self.places: dict[tuple[str, int], tuple[Path, int]] = {}
        self.rows = layout["embed_in.weight"].shape[0] if "embed_in.weight" in layout else None
        shards: list[StateDict] = [{} for _ in range(self.tp)]
        for name, t in layout.items():
            shape = _shard_shape(t.shape, partition_dim(name), self.tp)
            for rank in range(self.tp):
                shards[rank][name] = _fake(shape, t.dtype)
        for rank, module in enumerate(shards):
            if self.pp == 1:
                path = self.tag_dir / mp_file(rank)
                self._place(path, _engine_state(module, self.tp, iteration), module, rank)
            else:
                for index, layer in pipeline_layers(module, cfg.model.num_layers).items():
                    path = self.tag_dir / layer_file(index, rank)
                    self._place(path, layer, module, rank)
        if self.pp > 1:
            for rank in range(self.pp * self.tp):
                state = _engine_state(None, self.pp * self.tp, iteration)
                torch.save(state, self.tag_dir / mp_file(rank))
        self.written: set[tuple[str, int]] = set()

    def _place(self, path: Path, obj: Any, module: StateDict, rank: int) -> None:
        offsets = _layout_file(path, obj)
        for name, fake in module.items():
            if id(fake) in offsets:
                self.places[(name, rank)] = (path, offsets[id(fake)])

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the full tensor `name` (its tp slices into each rank's file)."""
        want = self.layout[name]
        if tuple(tensor.shape) != tuple(want.shape) or tensor.dtype != want.dtype:
            raise ValueError(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the layout says "
                f"{tuple(want.shape)} {want.dtype}"
            )
        if any((name, rank) in self.written for rank in range(self.tp)):
            raise ValueError(f"{name} written twice")
        dim = partition_dim(name)
        for rank in range(self.tp):
            part = tensor if dim is None or self.tp == 1 else shard(tensor, dim, rank, self.tp)
            path, offset = self.places[(name, rank)]
            fd = os.open(path, os.O_WRONLY)
            try:
                _pwrite(fd, part, offset)
            finally:
                os.close(fd)
            self.written.add((name, rank))

    def finish(self) -> Path:
        """Check every tensor was written, then the marker, config.yml, manifest and `latest`."""
        missing = sorted({n for n, r in self.places if (n, r) not in self.written})
        if missing:
            raise ValueError(f"never written: {missing[:5]}")
        for path in {p for p, _ in self.places.values()}:
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        (self.tag_dir / WEIGHTS_ONLY).write_text(
            "Model weights only (no optimizer state): start a run from them with "
            "`finetune: true`.\n"
        )
        write_config(self.cfg, self.tag_dir / "config.yml")
        write_manifest(self.tag_dir, self.iteration, self.rows)
        write_config(self.cfg, self.save_dir / "config.yml")
        (self.save_dir / "latest").write_text(tag_for(self.iteration))
        return self.tag_dir
