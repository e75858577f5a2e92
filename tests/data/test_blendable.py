import numpy as np
import pytest

from neox.data.blendable import (
    BlendableDataset,
    build_blend_index,
    normalize_weights,
    samples_per_dataset,
    weights_by_num_documents,
)
from neox.data.gpt_dataset import GPTDataset
from neox.data.indexed import IndexedDataset, IndexedDatasetBuilder


def running_counts(dataset_index, num_datasets):
    return np.stack([np.cumsum(dataset_index == i) for i in range(num_datasets)])


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 1], [1, 3], [7, 2, 1, 0]])
def test_blend_is_exact_when_shares_are_whole(weights):
    n = 1000
    dataset_index, sample_index = build_blend_index(weights, n)
    w = np.asarray(weights) / sum(weights)
    counts = np.bincount(dataset_index, minlength=len(w))
    np.testing.assert_array_equal(counts, np.round(w * n).astype(int))
    # Each dataset's samples are taken in order 0, 1, 2, ...
    for i in range(len(w)):
        np.testing.assert_array_equal(sample_index[dataset_index == i], np.arange(counts[i]))


@pytest.mark.parametrize("weights", [[0.37, 0.63], [0.1, 0.2, 0.3, 0.4], [5, 1, 1, 1, 0.01]])
def test_every_prefix_stays_close_to_its_share(weights):
    n = 20_000
    dataset_index, _ = build_blend_index(weights, n)
    w = normalize_weights(weights)
    counts = running_counts(dataset_index, len(w))
    target = w[:, None] * np.arange(1, n + 1)[None, :]
    bound = (1 + w * len(w)) / 2
    assert np.all(np.abs(counts - target) <= bound[:, None] + 1e-9)


def test_chunked_blend_matches_a_single_sort(monkeypatch):
    import neox.data.blendable as blendable

    weights = [0.2, 0.45, 0.35]
    whole = build_blend_index(weights, 5000)
    monkeypatch.setattr(blendable, "_CHUNK", 7)  # many chunk boundaries
    chunked = build_blend_index(weights, 5000)
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)


def test_blend_is_deterministic_and_interleaved():
    a, _ = build_blend_index([0.5, 0.5], 10)
    b, _ = build_blend_index([0.5, 0.5], 10)
    np.testing.assert_array_equal(a, b)
    assert a.tolist() == [0, 1] * 5


def test_weights_by_num_documents_follows_gpt_neox_formula():
    counts = [100, 900]
    for alpha in (1.0, 0.3):
        share = np.array(counts) / 1000
        expected = share**alpha / (share**alpha).sum() * (1 - share)
        np.testing.assert_allclose(
            weights_by_num_documents(counts, alpha), expected / expected.sum()
        )
    # A smaller alpha moves weight toward the small dataset.
    assert weights_by_num_documents(counts, 0.3)[0] > weights_by_num_documents(counts, 1.0)[0]
    assert weights_by_num_documents([5], 0.3) == [1.0]
    with pytest.raises(ValueError, match="documents"):
        weights_by_num_documents([5, 0])


def test_bad_weights_are_refused():
    for bad in ([], [0, 0], [1, -1], [float("nan"), 1]):
        with pytest.raises(ValueError, match="weights"):
            normalize_weights(bad)


def _write(prefix, token, num_docs):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(num_docs):
        builder.add_item(np.full(5, token))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return IndexedDataset(str(prefix))


def test_blendable_dataset_serves_each_source_in_proportion(tmp_path):
    # Source i holds only token i, so each sample shows where it came from.
    weights = [0.6, 0.3, 0.1]
    n = 200
    sources = [_write(tmp_path / f"src{i}", i, 4) for i in range(3)]
    per_dataset = samples_per_dataset(weights, n)
    assert all(k >= round(w * n) for k, w in zip(per_dataset, weights))
    datasets = [
        GPTDataset(f"train_{i}", s, np.arange(4), k, 6, seed=0)
        for i, (s, k) in enumerate(zip(sources, per_dataset))
    ]
    blend = BlendableDataset(datasets, weights, n)
    assert len(blend) == n
    origin = np.array([blend[i]["text"][0] for i in range(n)])
    np.testing.assert_array_equal(np.bincount(origin), [120, 60, 20])
    np.testing.assert_array_equal(
        blend[17]["text"], datasets[origin[17]][blend.dataset_sample_index[17]]["text"]
    )


def test_blendable_dataset_refuses_undersized_sources(tmp_path):
    sources = [_write(tmp_path / f"src{i}", i, 2) for i in range(2)]
    small = [GPTDataset(f"train_{i}", s, np.arange(2), 1, 4, seed=0) for i, s in enumerate(sources)]
    with pytest.raises(ValueError, match="samples_per_dataset"):
        BlendableDataset(small, [1, 1], 1000)
    with pytest.raises(ValueError, match="2 datasets but 3 weights"):
        BlendableDataset(small, [1, 1, 1], 4)
