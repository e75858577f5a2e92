"""The weights of a local Hugging Face model directory, read lazily.

Names, dtypes and shapes come from the file headers (safetensors) or a metadata-only load
(PyTorch .bin, onto the meta device), so the whole conversion can be planned and checked before
a weight is read; then `read` loads only the tensors asked for, opening each shard for that call
alone, so a converter that asks for one layer at a time holds about one layer in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

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
    files, _ = _weight_files(hf_dir)
    return files


def _weight_files(hf_dir: Path) -> tuple[list[Path], Optional[dict[str, str]]]:
    """The weight files, and the index's tensor name -> shard map when sharded."""
    for name in WEIGHT_FILES:
        if (hf_dir / name).is_file():
            return [hf_dir / name], None
        index = hf_dir / f"{name}.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                shards = [hf_dir / s for s in sorted(set(weight_map.values()))]
            except (ValueError, KeyError, TypeError) as e:
                raise HFWeightsError(
                    f"{index} is not a weight index ({e!r}); restore it from the model's download"
                ) from None
            missing = [str(s) for s in shards if not s.is_file()]
            if missing:
                raise HFWeightsError(
                    f"{', '.join(missing)} listed in {index.name} but missing; download the "
                    "whole model directory"
                )
            return shards, weight_map
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


@contextmanager
def _unreadable(path: Path) -> Iterator[None]:
    """safetensors' own errors (a Rust exception outside Python's hierarchy) as HFWeightsError."""
    from safetensors import SafetensorError

    try:
        yield
    except HFWeightsError:
        raise
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise HFWeightsError(
            f"{path} is not a readable safetensors file ({e}); it may be truncated or "
            "corrupt: download it again"
        ) from None


class HFWeights:
    """Tensor names -> their file, with `meta()` for the layout and `read()` for the data."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        self.files, weight_map = _weight_files(self.dir)
        self._meta: dict[str, torch.Tensor] = {}
        self._where: dict[str, Path] = {}
        for path in self.files:
            for name, tensor in self._file_meta(path).items():
                if name in self._where:
                    raise HFWeightsError(
                        f"tensor {name!r} is in both {self._where[name]} and {path}; "
                        "download the model directory again"
                    )
                self._meta[name] = tensor
                self._where[name] = path
        if weight_map is not None:
            self._check_index(weight_map)

    def _check_index(self, weight_map: dict[str, str]) -> None:
        """The index must list every tensor the shards hold, each in the shard that holds it:
        a mismatch is a shard from another download."""
        wrong = sorted(
            f"{name} (index: {shard}, files: "
            + (self._where[name].name if name in self._where else "none")
            + ")"
            for name, shard in weight_map.items()
            if self._where.get(name) != self.dir / shard
        )
        unlisted = sorted(set(self._where) - set(weight_map))
        problems = []
        if wrong:
            problems.append(f"listed where the files do not hold it: {', '.join(wrong[:3])}")
        if unlisted:
            problems.append(f"in a shard but not in the index: {', '.join(unlisted[:3])}")
        if problems:
            raise HFWeightsError(
                f"{self.dir}'s weight index does not match its shards ({'; '.join(problems)}); "
                "download the whole model directory again"
            )

    @staticmethod
    def _file_meta(path: Path) -> dict[str, torch.Tensor]:
        if path.suffix != ".safetensors":
            return _load_bin(path, "meta")
        from safetensors import safe_open

        out = {}
        # safe_open checks that the header is whole and its offsets cover the file exactly: a
        # truncated or corrupt file fails here, before anything is written.
        with _unreadable(path):
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

                with _unreadable(path), safe_open(str(path), framework="pt") as f:
                    for name in wanted:
                        out[name] = f.get_tensor(name)
            else:
                sd = _load_bin(path, "cpu")
                for name in wanted:
                    out[name] = sd[name]
                del sd
        return out
