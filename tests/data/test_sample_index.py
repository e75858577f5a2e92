import numpy as np
import pytest

from neox.data.sample_index import (
    build_doc_idx,
    build_sample_idx,
    build_sample_index,
    num_epochs_needed,
)


def stream_of(sizes, doc_idx):
    """The token stream as (document id, offset) pairs, built the slow obvious way."""
    return [(int(d), o) for d in doc_idx for o in range(int(sizes[d]))]


def windows_from_index(sizes, index, seq_length):
    stream = stream_of(sizes, index.doc_idx)
    out = []
    for i in range(len(index.sample_idx) - 1):
        d, o = index.sample_idx[i]
        start = stream.index((int(index.doc_idx[d]), int(o)), sum(sizes[index.doc_idx[:d]]))
        out.append(stream[start : start + seq_length + 1])
    return stream, out


@pytest.mark.parametrize("seq_length", [1, 3, 7, 16])
def test_samples_are_overlapping_windows_of_the_stream(seq_length):
    rng = np.random.RandomState(0)
    sizes = rng.randint(0, 9, size=23).astype(np.int32)  # includes empty documents
    sizes[0] = 5
    index = build_sample_index(sizes, np.arange(23), 40, seq_length, seed=3)
    stream, windows = windows_from_index(sizes, index, seq_length)
    assert len(windows) >= 40
    assert len(windows) == (len(stream) - 1) // seq_length
    for i, window in enumerate(windows):
        assert window == stream[i * seq_length : i * seq_length + seq_length + 1]
        # The next row marks this sample's last token.
        d, o = index.sample_idx[i + 1]
        assert window[-1] == (int(index.doc_idx[d]), int(o))
    assert any(len({d for d, _ in w}) > 1 for w in windows), "some samples span documents"


def test_sample_idx_never_points_at_an_empty_document_or_past_one():
    sizes = np.array([3, 0, 0, 4, 0, 2], dtype=np.int32)
    doc_idx = np.arange(6)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length=1)
    for d, o in sample_idx:
        assert 0 <= o < sizes[doc_idx[d]]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    docs = np.arange(10, 60)
    doc_idx = build_doc_idx(docs, 4, np.random.RandomState(1))
    epochs = doc_idx.reshape(4, 50)
    for epoch in epochs:
        assert sorted(epoch) == list(docs)
    assert not np.array_equal(epochs[0], epochs[1])


def test_enough_epochs_for_many_samples_of_tiny_data():
    sizes = np.array([3, 2], dtype=np.int32)  # 5 tokens per epoch
    index = build_sample_index(sizes, np.arange(2), num_samples=1000, seq_length=8, seed=0)
    assert len(index.shuffle_idx) >= 1000
    assert len(index.doc_idx) == 2 * num_epochs_needed(5, 8, 1000)
    # One epoch fewer would not have been enough.
    assert ((num_epochs_needed(5, 8, 1000) - 1) * 5 - 1) // 8 < 1000


def test_shuffle_is_a_permutation_fixed_by_the_seed():
    sizes = np.full(100, 7, dtype=np.int32)
    a = build_sample_index(sizes, np.arange(100), 50, 5, seed=11)
    b = build_sample_index(sizes, np.arange(100), 50, 5, seed=11)
    c = build_sample_index(sizes, np.arange(100), 50, 5, seed=12)
    assert sorted(a.shuffle_idx.tolist()) == list(range(len(a.sample_idx) - 1))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.doc_idx, c.doc_idx)
    assert not np.array_equal(a.shuffle_idx, c.shuffle_idx)


def test_empty_data_is_refused():
    with pytest.raises(ValueError, match="no tokens"):
        build_sample_index(np.zeros(3, np.int32), np.arange(3), 5, 4, 0)
    with pytest.raises(ValueError, match="no documents"):
        build_sample_index(np.ones(3, np.int32), np.arange(0), 5, 4, 0)


def test_vectorised_build_is_fast_for_a_million_documents():
    import time

    sizes = np.random.RandomState(0).randint(1, 400, size=1_000_000).astype(np.int32)
    start = time.perf_counter()
    index = build_sample_index(sizes, np.arange(len(sizes)), 200_000, 2048, seed=0)
    assert time.perf_counter() - start < 20
    assert len(index.shuffle_idx) >= 200_000
