"""Megatron "mmap" indexed dataset: token ids in <prefix>.bin, sequence index in <prefix>.idx.

Layout of the .idx file (all little endian), byte-compatible with gpt-neox and Megatron-LM:

    magic     9 bytes   b"MMIDIDX\\x00\\x00"
    version   uint64    1
    dtype     uint8     code from DTYPE_CODES (token type of the .bin file)
    len       uint64    number of sequences
    doc_count uint64    number of entries in doc_idx (documents + 1)
    sizes     int32[len]        tokens per sequence
    pointers  int64[len]        byte offset of each sequence in the .bin file
    doc_idx   int64[doc_count]  index of the first sequence of each document, then len

The .bin file is the sequences' tokens back to back, nothing else.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
from array import array
from collections.abc import Iterable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Codes as gpt-neox/Megatron write them; a reader must map them the same way.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float32),
    7: np.dtype(np.float64),
    8: np.dtype(np.uint16),
}
# Label datasets (gpt-neox's label_data_paths) hold the token id where trained and this where not
# (a prompt, another role's turn, padding); they are written as int32 so it fits.
IGNORE_INDEX = -100
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, len, doc_count

# Large write buffer: token chunks are appended many times per second during preprocessing.
_WRITE_BUFFER = 8 << 20
_RERUN = "re-run tools/preprocess_data.py (or tools/merge_datasets.py) to rebuild it"


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair is missing, corrupt, truncated or inconsistent."""


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest token dtype gpt-neox uses for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dtype_code(dtype: np.dtype) -> int:
    """The .idx code of a token dtype; raises for types the format cannot store."""
    dtype = np.dtype(dtype)
    if dtype.newbyteorder("<") != dtype and dtype.itemsize > 1:
        raise IndexedDatasetError(f"token dtype {dtype} must be little endian")
    try:
        return _CODE_OF[np.dtype(dtype.type)]
    except KeyError:
        names = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise IndexedDatasetError(
            f"token dtype {dtype} cannot be stored in an indexed dataset; use one of {names}"
        ) from None


def index_path(prefix: str) -> str:
    """Path of the index file of a dataset prefix."""
    return prefix + ".idx"


def data_path(prefix: str) -> str:
    """Path of the token file of a dataset prefix."""
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    """True when both <prefix>.idx and <prefix>.bin exist."""
    return os.path.isfile(index_path(prefix)) and os.path.isfile(data_path(prefix))


def write_index(
    idx_path: str, dtype: np.dtype, sizes: np.ndarray | Sequence[int], doc_idx: Sequence[int]
) -> None:
    """Write an .idx file for sequences of `sizes` tokens stored back to back (to a temp, then renamed)."""
    dtype = np.dtype(dtype)
    sizes64 = np.asarray(sizes, dtype=np.int64)
    if sizes64.size and (sizes64.min() < 0 or sizes64.max() > np.iinfo(np.int32).max):
        raise IndexedDatasetError(f"{idx_path}: sequence sizes must fit int32 and be >= 0")
    pointers = np.zeros(len(sizes64), dtype=np.int64)
    np.cumsum(sizes64[:-1], out=pointers[1:])
    pointers *= dtype.itemsize
    doc = np.asarray(doc_idx, dtype=np.int64)
    tmp = idx_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(sizes64), len(doc)))
        f.write(sizes64.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc.astype("<i8").tobytes())
    # The index appears under its real name only once complete.
    os.replace(tmp, idx_path)


class IndexedDatasetBuilder:
    """Writes sequences of tokens to a .bin file, then the matching .idx on `finalize`."""

    def __init__(self, bin_path: str, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # refuse unsupported types before creating any file
        self.bin_path = bin_path
        self._file = open(bin_path, "wb", buffering=_WRITE_BUFFER)
        # array("q") keeps a billion sizes in 8 GB instead of 28+ GB of Python ints.
        self._sizes = array("q")
        self._doc_idx = array("q", [0])
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None

    def _as_tokens(self, tokens: np.ndarray | Iterable[int]) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if self._info is not None and arr.size and arr.dtype.kind in "iub":
                lo, hi = int(arr.min()), int(arr.max())
                if lo < self._info.min or hi > self._info.max:
                    raise ValueError(
                        f"token id out of range for {self.dtype} ({lo}..{hi}); "
                        "build the dataset with best_dtype(vocab_size)"
                    )
            arr = arr.astype(self.dtype)
        return arr

    def add_item(self, tokens: np.ndarray | Iterable[int]) -> None:
        """Append one sequence."""
        arr = self._as_tokens(tokens)
        self._file.write(arr.tobytes())
        self._sizes.append(arr.size)

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._doc_idx.append(len(self._sizes))

    def add_documents(self, tokens: np.ndarray, sizes: Sequence[int] | np.ndarray) -> None:
        """Append many one-sequence documents at once: `tokens` is their concatenation."""
        arr = self._as_tokens(tokens)
        sizes = np.asarray(sizes, dtype=np.int64)
        if int(sizes.sum()) != arr.size:
            raise ValueError(f"sizes add up to {int(sizes.sum())} tokens, got {arr.size} tokens")
        self._file.write(arr.tobytes())
        start = len(self._sizes)
        self._sizes.frombytes(sizes.tobytes())
        self._doc_idx.frombytes(np.arange(start + 1, start + len(sizes) + 1).tobytes())

    def merge_file_(self, other_prefix: str) -> None:
        """Append every sequence and document of the dataset at `other_prefix`."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"cannot merge {other_prefix}: its tokens are {other.dtype}, this dataset's are "
                f"{self.dtype}; preprocess all shards with the same tokenizer"
            )
        offset = len(self._sizes)
        self._sizes.frombytes(other.sizes.astype(np.int64).tobytes())
        # Unlike gpt-neox's builder, keep the other dataset's document boundaries.
        self._doc_idx.frombytes((other.doc_idx[1:] + offset).astype(np.int64).tobytes())
        other.close()
        self._file.flush()
        with open(data_path(other_prefix), "rb") as f:
            shutil.copyfileobj(f, self._file, _WRITE_BUFFER)

    @property
    def num_sequences(self) -> int:
        """Sequences added so far."""
        return len(self._sizes)

    @property
    def bytes_written(self) -> int:
        """Bytes of tokens added so far."""
        return self._file.tell()

    def finalize(self, idx_path: str) -> None:
        """Close the .bin file and write the .idx file."""
        self._file.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int64) if self._sizes else np.zeros(0)
        write_index(idx_path, self.dtype, sizes, np.frombuffer(self._doc_idx, dtype=np.int64))

    def close(self) -> None:
        """Close the .bin file without writing an index (an abandoned build)."""
        self._file.close()


class IndexedDataset:
    """Read-only, memory-mapped view of <prefix>.bin/.idx, validated on open."""

    def __init__(self, path_prefix: str):
        self._open(path_prefix)

    def _open(self, prefix: str) -> None:
        self.prefix = prefix
        idx, bin_ = index_path(prefix), data_path(prefix)
        for p in (idx, bin_):
            if not os.path.isfile(p):
                raise FileNotFoundError(
                    f"indexed dataset file {p} not found; expected <prefix>.idx and <prefix>.bin "
                    f"for prefix {prefix!r} (a data path is given without extension)"
                )
        idx_size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            head = f.read(_HEADER.size)
        if not MAGIC.startswith(head[:9]):
            raise IndexedDatasetError(
                f"{idx} is not an mmap indexed dataset index (bad magic {head[:9]!r}); {_RERUN}"
            )
        if len(head) < _HEADER.size:
            raise IndexedDatasetError(
                f"{idx} is truncated: {idx_size} bytes, shorter than its header; {_RERUN}"
            )
        _, version, code, length, doc_count = _HEADER.unpack(head)
        if version != VERSION:
            raise IndexedDatasetError(f"{idx} has version {version}, only {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx} has unknown token dtype code {code}; {_RERUN}")
        self.dtype = DTYPE_CODES[code]
        expected = _HEADER.size + 12 * length + 8 * doc_count
        if expected != idx_size:
            raise IndexedDatasetError(
                f"{idx} is corrupt or truncated: its header promises {length} sequences and "
                f"{doc_count} document entries ({expected} bytes) but the file has {idx_size} bytes; "
                f"{_RERUN}"
            )
        self._idx_map = np.memmap(idx, mode="r")
        off = _HEADER.size
        self.sizes = np.frombuffer(self._idx_map, dtype="<i4", count=length, offset=off)
        self._pointers = np.frombuffer(
            self._idx_map, dtype="<i8", count=length, offset=off + 4 * length
        )
        self.doc_idx = np.frombuffer(
            self._idx_map, dtype="<i8", count=doc_count, offset=off + 12 * length
        )
        self._check_consistent(idx, bin_)
        bin_size = os.path.getsize(bin_)
        # np.memmap refuses empty files; an empty dataset has nothing to map.
        self._bin_map = np.memmap(bin_, mode="r") if bin_size else np.zeros(0, np.uint8)

    def _check_consistent(self, idx: str, bin_: str) -> None:
        # Cheap O(1) checks on open; validate() does the full scan.
        length = len(self.sizes)
        bin_size = os.path.getsize(bin_)
        end = int(self._pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if length else 0
        if length and int(self._pointers[0]) != 0:
            raise IndexedDatasetError(f"{idx} is corrupt: first pointer is not 0; {_RERUN}")
        if end != bin_size:
            raise IndexedDatasetError(
                f"{bin_} has {bin_size} bytes but {idx} describes {end} bytes of {self.dtype} "
                f"tokens: the pair is truncated or from different runs; {_RERUN}"
            )
        if len(self.doc_idx) == 0 or self.doc_idx[0] != 0 or self.doc_idx[-1] > length:
            raise IndexedDatasetError(
                f"{idx} is corrupt: document index must start at 0 and end at most at {length}; "
                f"{_RERUN}"
            )

    def validate(self) -> None:
        """Full consistency scan: sizes non-negative, pointers contiguous, doc_idx sorted."""
        idx = index_path(self.prefix)
        if len(self.sizes) and self.sizes.min() < 0:
            raise IndexedDatasetError(f"{idx} is corrupt: negative sequence size; {_RERUN}")
        expected = np.zeros(len(self.sizes), dtype=np.int64)
        np.cumsum(self.sizes[:-1], out=expected[1:])
        if not np.array_equal(expected * self.dtype.itemsize, self._pointers):
            raise IndexedDatasetError(f"{idx} is corrupt: pointers are not contiguous; {_RERUN}")
        if np.any(np.diff(self.doc_idx) < 0):
            raise IndexedDatasetError(f"{idx} is corrupt: document index decreases; {_RERUN}")

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        """Number of documents (len(doc_idx) - 1)."""
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        """Total tokens in the .bin file."""
        return self._bin_map.nbytes // self.dtype.itemsize

    def largest_token(self, budget: int = 1 << 26, windows: int = 64) -> tuple[int, bool]:
        """(largest token id, whether every token was read): the whole .bin when it holds at
        most `budget` tokens, else `windows` evenly spaced windows of budget / windows tokens
        (data of another tokenizer has large ids throughout, so a window finds one)."""
        tokens = np.frombuffer(self._bin_map, dtype=self.dtype)
        if tokens.size == 0:
            return -1, True
        if tokens.size <= budget:
            return int(tokens.max()), True
        width = budget // windows
        starts = np.linspace(0, tokens.size - width, windows, dtype=np.int64)
        return max(int(tokens[a : a + width].max()) for a in starts), False

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence `idx` from `offset`, `length` of them (default: to the end)."""
        n = len(self.sizes)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {self.prefix} with {n} sequences")
        idx = int(idx) % n
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                f"of {size} tokens in {self.prefix}"
            )
        start = int(self._pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, idx: int) -> np.ndarray:
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"indexed dataset index must be an int, got {type(idx).__name__}")
        return self.get(int(idx))

    def close(self) -> None:
        """Drop the memory maps (arrays already returned keep theirs alive)."""
        self._idx_map = self._bin_map = None
        self.sizes = self._pointers = self.doc_idx = None

    # Pickle by prefix so DataLoader workers reopen the maps instead of copying them.
    def __getstate__(self) -> str:
        return self.prefix

    def __setstate__(self, prefix: str) -> None:
        self._open(prefix)


def check_label_dataset(text: IndexedDataset, label: IndexedDataset) -> None:
    """A label dataset must hold one label per token of its text dataset, document by document."""
    if len(text.sizes) != len(label.sizes) or not np.array_equal(text.sizes, label.sizes):
        differ = np.flatnonzero(text.sizes[: len(label.sizes)] != label.sizes[: len(text.sizes)])
        where = (
            f"document {int(differ[0])} has {int(text.sizes[differ[0]])} tokens but "
            f"{int(label.sizes[differ[0]])} labels"
            if differ.size
            else f"{len(text.sizes)} documents but {len(label.sizes)} label documents"
        )
        raise IndexedDatasetError(
            f"label dataset {label.prefix}.bin/.idx does not match its text dataset "
            f"{text.prefix}.bin/.idx: {where}; write both with one run of "
            "tools/preprocess_data_with_chat_template.py (or _with_mask.py)"
        )


def find_datasets(inputs: str | Sequence[str]) -> list[str]:
    """Dataset prefixes from a directory (every .bin/.idx pair, sorted) or a list of prefixes."""
    if isinstance(inputs, str) and os.path.isdir(inputs):
        names = sorted(os.listdir(inputs))
        stems = {n[: -len(".idx")] for n in names if n.endswith(".idx")}
        stems |= {n[: -len(".bin")] for n in names if n.endswith(".bin")}
        prefixes = [os.path.join(inputs, s) for s in sorted(stems)]
        if not prefixes:
            raise FileNotFoundError(f"directory {inputs} holds no .bin/.idx datasets")
    else:
        specs = inputs.split(",") if isinstance(inputs, str) else list(inputs)
        prefixes = [s.strip().removesuffix(".bin").removesuffix(".idx") for s in specs if s.strip()]
    for p in prefixes:
        for path in (index_path(p), data_path(p)):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{path} not found: dataset {p} needs both .bin and .idx; re-create the shard "
                    "or leave it out"
                )
    return prefixes


def merge_datasets(inputs: str | Sequence[str], output_prefix: str, overwrite: bool = False) -> str:
    """Concatenate datasets into <output_prefix>.bin/.idx; all are checked before writing."""
    prefixes = find_datasets(inputs)
    if os.path.abspath(output_prefix) in {os.path.abspath(p) for p in prefixes}:
        raise ValueError(f"output {output_prefix} is also an input; choose another --output-prefix")
    if not overwrite and (
        os.path.exists(data_path(output_prefix)) or os.path.exists(index_path(output_prefix))
    ):
        raise FileExistsError(
            f"output dataset {output_prefix}.bin/.idx already exists; choose another "
            "--output-prefix or pass --overwrite"
        )
    # Open (and so validate) every shard and compare dtypes before writing a byte.
    dtypes = {}
    for p in prefixes:
        ds = IndexedDataset(p)
        dtypes[p] = ds.dtype
        ds.close()
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{p}: {d}" for p, d in dtypes.items())
        raise IndexedDatasetError(
            f"datasets have different token dtypes ({listing}); they were made with different "
            "tokenizers and cannot be merged"
        )
    tmp = f".tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(data_path(output_prefix) + tmp, dtypes[prefixes[0]])
    try:
        for p in prefixes:
            builder.merge_file_(p)
        sequences = builder.num_sequences
        builder.finalize(index_path(output_prefix) + tmp)
    except BaseException:
        builder.close()
        for path in (data_path(output_prefix) + tmp, index_path(output_prefix) + tmp):
            if os.path.exists(path):
                os.remove(path)
        raise
    if os.path.exists(index_path(output_prefix)):
        os.remove(index_path(output_prefix))  # never pair a new .bin with an old .idx
    os.replace(data_path(output_prefix) + tmp, data_path(output_prefix))
    os.replace(index_path(output_prefix) + tmp, index_path(output_prefix))
    merged = IndexedDataset(output_prefix)
    summary = (
        f"merged {len(prefixes)} datasets into {output_prefix}: {sequences} sequences, "
        f"{merged.num_documents} documents, {merged.num_tokens} tokens of {merged.dtype}"
    )
    merged.close()
    return summary
