"""The weights of a local Hugging Face model directory, read lazily.

Names, dtypes and shapes come from the file headers (safetensors) or a metadata-only load
(PyTorch .bin, onto the meta device), so the whole conversion can be planned and checked before
a weight is read; then `read` loads only the tensors asked for, opening each shard for that call
alone, so a converter that asks for one layer at a time holds about one layer in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

# Single-file names; the sharded forms add ".index.json" (transformers' layout).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class HFWeightsError(ValueError):
    """The directory's weight files are missing or unreadable; the message names the file."""


def weight_files(hf_dir: Path) -> list[Path]:
    """The weight files of hf_dir: one file, or the shards its *.index.json lists."""
    for name in WEIGHT_FILES:
        if (hf_dir / name).is_file():
            return [hf_dir / name]
        index = hf_dir / f"{name}.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise HFWeightsError(f"{index} is not a weight index ({e!r})") from None
            shards = [hf_dir / s for s in sorted(set(weight_map.values()))]
            missing = [str(s) for s in shards if not s.is_file()]
            if missing:
                raise HFWeightsError(
                    f"{', '.join(missing)} listed in {index.name} but missing; download the "
                    "whole model directory"
                )
            return shards
    raise HFWeightsError(
        f"{hf_dir} has no weights: expected {' or '.join(WEIGHT_FILES)} (or a sharded "
        "*.index.json beside its shards)"
    )


def _load_bin(path: Path, map_location: str) -> dict[str, torch.Tensor]:
    """A PyTorch weight file through torch's weights-only unpickler (no code runs), mapped
    rather than read where its format allows."""
    try:
        try:
            sd = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
        except RuntimeError:  # the pre-zip format cannot be mapped
            sd = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # the weights-only unpickler refuses anything but tensors
        raise HFWeightsError(f"{path} cannot be read as plain tensors: {e}") from None
    if not isinstance(sd, dict) or not all(isinstance(t, torch.Tensor) for t in sd.values()):
        raise HFWeightsError(f"{path} is not a state dict (tensor names -> tensors)")
    return sd


class HFWeights:
    """Tensor names -> their file, with `meta()` for the layout and `read()` for the data."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        self.files = weight_files(self.dir)
        self._meta: dict[str, torch.Tensor] = {}
        self._where: dict[str, Path] = {}
        for path in self.files:
            for name, tensor in self._file_meta(path).items():
                self._meta[name] = tensor
                self._where[name] = path

    @staticmethod
    def _file_meta(path: Path) -> dict[str, torch.Tensor]:
        if path.suffix != ".safetensors":
            return _load_bin(path, "meta")
        from safetensors import safe_open

        out = {}
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(part.get_dtype())
                    if dtype is None:
                        raise HFWeightsError(
                            f"{path}: tensor {name!r} has dtype {part.get_dtype()}, which neox "
                            f"does not read ({', '.join(SAFETENSORS_DTYPES)})"
                        )
                    out[name] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
        except (OSError, RuntimeError, ValueError) as e:
            if isinstance(e, HFWeightsError):
                raise
            raise HFWeightsError(f"{path} is not a readable safetensors file ({e})") from None
        return out

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor as a meta tensor of its dtype and shape (no data read)."""
        return dict(self._meta)

    def sizes(self) -> dict[Path, int]:
        """Each weight file's size in bytes."""
        return {path: path.stat().st_size for path in self.files}

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors `names`, each shard opened once for this call and closed after it."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._where[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, wanted in by_file.items():
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    for name in wanted:
                        out[name] = f.get_tensor(name)
            else:
                sd = _load_bin(path, "cpu")
                for name in wanted:
                    out[name] = sd[name]
                del sd
        return out
