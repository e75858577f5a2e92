"""Tests for neox/data/indexed.py: exact on-disk layout, round trips, merge, and corruption errors."""

import os
import pickle
import struct

import numpy as np
import pytest

from neox.data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_dtype,
    dataset_exists,
)


def build(prefix, docs, dtype=np.uint16):
    """docs: list of documents, each a list of sequences (lists of ints)."""
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    b.finalize(str(prefix) + ".idx")
    return str(prefix)


def expected_idx(dtype_code, itemsize, sizes, doc_idx):
    """The .idx bytes written straight from the format description, independently of the writer."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, dtype_code, len(sizes), len(doc_idx))
    out += struct.pack(f"<{len(sizes)}i", *sizes)
    ptr, pointers = 0, []
    for s in sizes:
        pointers.append(ptr)
        ptr += s * itemsize
    out += struct.pack(f"<{len(sizes)}q", *pointers)
    out += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    return out


def test_best_dtype_thresholds():
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(250000) == np.int32


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5)])
def test_exact_bytes_on_disk(tmp_path, dtype, code):
    docs = [[[5, 6, 7]], [[1], [2, 3]], [[60000 if dtype == np.uint16 else 70000]]]
    prefix = build(tmp_path / "d", docs, dtype)
    sizes, doc_idx = [3, 1, 2, 1], [0, 1, 3, 4]
    itemsize = np.dtype(dtype).itemsize
    assert open(prefix + ".idx", "rb").read() == expected_idx(code, itemsize, sizes, doc_idx)
    flat = [t for doc in docs for seq in doc for t in seq]
    fmt = {np.uint16: "H", np.int32: "i", np.int64: "q"}[dtype]
    assert open(prefix + ".bin", "rb").read() == struct.pack(f"<{len(flat)}{fmt}", *flat)


def test_round_trip_and_get(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50257, size=n) for n in (0, 1, 17, 300, 2)]
    prefix = build(tmp_path / "d", [[s] for s in seqs])
    ds = IndexedDataset(prefix)
    assert len(ds) == 5 and ds.num_documents == 5 and ds.dtype == np.uint16
    assert ds.sizes.tolist() == [0, 1, 17, 300, 2]
    assert ds.doc_idx.tolist() == [0, 1, 2, 3, 4, 5]
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
    np.testing.assert_array_equal(ds.get(3, offset=10, length=5), seqs[3][10:15])
    np.testing.assert_array_equal(ds.get(3, offset=295), seqs[3][295:])
    np.testing.assert_array_equal(ds[-1], seqs[-1])
    assert ds.num_tokens == 320
    ds.validate()
    with pytest.raises(IndexError, match="out of range"):
        ds[5]
    with pytest.raises(IndexError, match="sequence 2 of 17 tokens"):
        ds.get(2, offset=10, length=8)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(ds))[3], seqs[3])


def test_add_documents_equals_add_item(tmp_path):
    seqs = [[1, 2], [3], [4, 5, 6]]
    a = build(tmp_path / "a", [[s] for s in seqs])
    b = IndexedDatasetBuilder(str(tmp_path / "b.bin"), np.uint16)
    b.add_documents(np.array([1, 2, 3, 4, 5, 6]), [2, 1, 3])
    b.finalize(str(tmp_path / "b.idx"))
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(str(tmp_path / "b") + ext, "rb").read()
    with pytest.raises(ValueError, match="add up to"):
        IndexedDatasetBuilder(str(tmp_path / "c.bin"), np.uint16).add_documents(
            np.array([1, 2]), [3]
        )


def test_token_out_of_range_for_dtype(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    with pytest.raises(ValueError, match="out of range for uint16"):
        b.add_item(np.array([1, 70000], dtype=np.int64))
    with pytest.raises(ValueError, match="out of range"):
        b.add_item(np.array([-1], dtype=np.int32))


def test_empty_dataset(tmp_path):
    prefix = build(tmp_path / "e", [])
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0] and ds.num_tokens == 0


def test_merge_keeps_documents_and_checks_dtype(tmp_path):
    a = build(tmp_path / "a", [[[1, 2], [3]], [[4]]])
    b = build(tmp_path / "b", [[[5, 6, 7]]])
    m = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    m.merge_file_(a)
    m.merge_file_(b)
    m.finalize(str(tmp_path / "m.idx"))
    ds = IndexedDataset(str(tmp_path / "m"))
    assert ds.sizes.tolist() == [2, 1, 1, 3]
    assert ds.doc_idx.tolist() == [0, 2, 3, 4]
    np.testing.assert_array_equal(ds[3], [5, 6, 7])
    ds.validate()
    wide = build(tmp_path / "w", [[[1]]], np.int32)
    m2 = IndexedDatasetBuilder(str(tmp_path / "m2.bin"), np.uint16)
    with pytest.raises(IndexedDatasetError, match="its tokens are int32"):
        m2.merge_file_(wide)


def test_dataset_exists_and_missing_file(tmp_path):
    prefix = build(tmp_path / "d", [[[1]]])
    assert dataset_exists(prefix)
    os.remove(prefix + ".bin")
    assert not dataset_exists(prefix)
    with pytest.raises(FileNotFoundError, match=r"d\.bin not found"):
        IndexedDataset(prefix)


def corrupt(path, offset=None, data=None, truncate=None):
    raw = bytearray(open(path, "rb").read())
    if truncate is not None:
        raw = raw[:truncate]
    if data is not None:
        raw[offset : offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize(
    "ext,kwargs,message",
    [
        (".idx", dict(offset=0, data=b"XXXX"), "bad magic"),
        (".idx", dict(offset=9, data=struct.pack("<Q", 2)), "version 2"),
        (".idx", dict(offset=17, data=b"\x09"), "unknown token dtype code 9"),
        (".idx", dict(truncate=20), "truncated"),
        (".idx", dict(truncate=60), "promises 3 sequences"),
        (".idx", dict(offset=18, data=struct.pack("<Q", 4)), "promises 4 sequences"),
        (".bin", dict(truncate=10), "has 10 bytes"),
        (".bin", dict(offset=14, data=b"\x00\x00"), "has 16 bytes"),
        (".idx", dict(offset=17, data=b"\x04"), "int32"),  # wrong dtype: sizes no longer fit
    ],
)
def test_corrupt_files_raise_clear_errors(tmp_path, ext, kwargs, message):
    prefix = build(tmp_path / "d", [[[1, 2, 3]], [[4, 5]], [[6, 7]]])
    corrupt(prefix + ext, **kwargs)
    with pytest.raises(IndexedDatasetError, match=message) as err:
        IndexedDataset(prefix)
    assert "d.idx" in str(err.value) or "d.bin" in str(err.value)
    assert "re-run" in str(err.value) or "supported" in str(err.value)


def test_validate_catches_bad_pointers(tmp_path):
    prefix = build(tmp_path / "d", [[[1, 2, 3]], [[4, 5]], [[6, 7]]])
    # Second pointer moved; first and last still look right, so only the full scan sees it.
    corrupt(prefix + ".idx", offset=34 + 12 + 8, data=struct.pack("<q", 4))
    ds = IndexedDataset(prefix)
    with pytest.raises(IndexedDatasetError, match="pointers are not contiguous"):
        ds.validate()


def test_unsupported_dtype_refused_before_writing(tmp_path):
    with pytest.raises(IndexedDatasetError, match="cannot be stored"):
        IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint32)
    assert not (tmp_path / "d.bin").exists()
