import dataclasses
import itertools

import numpy as np
import pytest
import torch

from neox.config import load_dict
from neox.config.data import parse_split
from neox.data.blendable import BlendableDataset, build_blend_index, weights_by_num_documents
from neox.data.indexed import IndexedDatasetBuilder
from neox.data.loader import ReadPlan, build_train_valid_test_loaders, split_documents


def write_tagged(prefix, num_docs, tag=None, doc_len=6):
    """Documents whose tokens name them: token d (or `tag`) repeated `doc_len` times."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for d in range(num_docs):
        builder.add_item(np.full(doc_len, d if tag is None else tag))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def take(iterator, n):
    return [b["text"] for b in itertools.islice(iterator, n)]


READ_KEYS = {f.name for f in dataclasses.fields(ReadPlan)}


def loaders(**kwargs):
    """Loaders of a config of seq_length 8, seed 3, no worker processes and micro batch 2, with
    `kwargs`' config keys and ReadPlan fields."""
    read = {"micro_batch_size": 2, **{k: v for k, v in kwargs.items() if k in READ_KEYS}}
    keys = {k: v for k, v in kwargs.items() if k not in READ_KEYS}
    cfg = load_dict({"seq_length": 8, "seed": 3, "num_workers": 0, **keys})
    return build_train_valid_test_loaders(cfg, ReadPlan(**read))


def test_split_weights_and_document_ranges():
    np.testing.assert_allclose(parse_split("949,50,1"), [0.949, 0.05, 0.001])
    np.testing.assert_allclose(parse_split("1/1/2"), [0.25, 0.25, 0.5])
    np.testing.assert_allclose(parse_split("1,0,0"), [1, 0, 0])
    np.testing.assert_allclose(parse_split("3"), [1, 0, 0])
    ranges = split_documents("949, 50, 1", 1000)
    assert [r.size for r in ranges] == [949, 50, 1]
    assert np.array_equal(np.concatenate(ranges), np.arange(1000))
    assert [r.size for r in split_documents("1,1,1", 10)] == [3, 4, 3]
    for bad in ("a,b", "1,1,1,1", "0,0,0", "-1,2,0"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)


def test_data_path_splits_into_disjoint_document_ranges(tmp_path):
    prefix = write_tagged(tmp_path / "corpus", 100)
    out = loaders(data_path=prefix, split="80,10,10", num_samples=(40, 10, 10))
    seen = {}
    for name in ("train", "valid", "test"):
        batches = take(getattr(out, name), 20)
        assert all(b.shape == (2, 9) and b.dtype == torch.int64 for b in batches)
        seen[name] = set(torch.cat(batches).unique().tolist())
    assert seen["train"] <= set(range(80))
    assert seen["valid"] <= set(range(80, 90)) and seen["test"] <= set(range(90, 100))


def test_empty_split_with_samples_requested_names_the_split(tmp_path):
    prefix = write_tagged(tmp_path / "tiny", 3)
    with pytest.raises(
        ValueError, match=r"valid split no documents.*3 documents|3 documents.*valid"
    ):
        loaders(data_path=prefix, split="949,50,1", num_samples=(10, 4, 0))
    # A zero-weight split for which nothing is requested is fine.
    out = loaders(data_path=prefix, split="1,0,0", num_samples=(10, 0, 0))
    assert out.valid is None and out.test is None and out.valid_dataset is None
    assert len(take(out.train, 3)) == 3


def test_train_stream_never_ends_and_resumes_exactly(tmp_path):
    prefix = write_tagged(tmp_path / "tiny", 4)  # 24 tokens: a handful of samples per epoch
    full = take(loaders(data_path=prefix, split="1,0,0", num_samples=(20, 0, 0)).train, 50)
    assert len(full) == 50  # far past the 20 samples requested: no StopIteration
    for steps in (1, 9, 30):
        resumed = loaders(
            data_path=prefix,
            split="1,0,0",
            num_samples=(20, 0, 0),
            consumed_train_samples=steps * 2,
        )
        assert not resumed.train_dataset.index_built, "the index is loaded from the cache"
        tail = take(resumed.train, 50 - steps)
        assert all(torch.equal(a, b) for a, b in zip(tail, full[steps:]))


def test_data_parallel_ranks_split_each_global_batch(tmp_path):
    prefix = write_tagged(tmp_path / "corpus", 50)
    common = dict(data_path=prefix, split="1,0,0", num_samples=(64, 0, 0), data_parallel_size=2)
    single = take(loaders(data_path=prefix, split="1,0,0", num_samples=(64, 0, 0)).train, 8)
    rank0 = take(loaders(data_parallel_rank=0, **common).train, 4)
    rank1 = take(loaders(data_parallel_rank=1, **common).train, 4)
    for step in range(4):
        global_batch = torch.cat([rank0[step], rank1[step]])
        assert torch.equal(global_batch, torch.cat(single[2 * step : 2 * step + 2]))


def test_blended_paths_follow_their_weights(tmp_path):
    paths = [write_tagged(tmp_path / f"src{i}", 5, tag=i) for i in range(3)]
    out = loaders(
        train_data_paths=paths,
        train_data_weights=[2, 1, 1],
        valid_data_paths=paths[:1],
        num_samples=(40, 4, 0),
    )
    assert isinstance(out.train_dataset, BlendableDataset)
    origin = torch.cat(take(out.train, 20))[:, 0]
    assert torch.bincount(origin).tolist() == [20, 10, 10]
    assert set(torch.cat(take(out.valid, 5)).unique().tolist()) == {0}
    assert out.test is None


def test_weight_by_num_documents_sets_the_blend(tmp_path):
    paths = [write_tagged(tmp_path / "small", 2, tag=0), write_tagged(tmp_path / "big", 18, tag=1)]
    out = loaders(
        train_data_paths=paths,
        train_data_weights=[1, 1],  # replaced by document-count weights
        weight_by_num_documents=True,
        weighted_sampler_alpha=0.5,
        num_samples=(100, 0, 0),
    )
    expected = weights_by_num_documents([2, 18], 0.5)
    np.testing.assert_allclose(out.train_dataset.weights, expected)
    origin = torch.cat(take(out.train, 50))[:, 0].numpy()
    np.testing.assert_array_equal(origin, build_blend_index(expected, 100)[0])


def test_bad_sources_are_refused_before_any_work(tmp_path):
    prefix = write_tagged(tmp_path / "corpus", 5)
    with pytest.raises(ValueError, match="not both"):
        loaders(data_path=prefix, train_data_paths=[prefix], num_samples=(4, 0, 0))
    with pytest.raises(ValueError, match="no data"):
        loaders(num_samples=(4, 0, 0))
    with pytest.raises(ValueError, match="no valid_data_paths"):
        loaders(train_data_paths=[prefix], num_samples=(4, 2, 0))
    with pytest.raises(ValueError, match="train_data_weights has 1 entries but train_data_paths"):
        loaders(train_data_paths=[prefix, prefix], train_data_weights=[1], num_samples=(4, 0, 0))
    with pytest.raises(ValueError, match="data_parallel_rank=2"):
        loaders(data_path=prefix, num_samples=(4, 0, 0), data_parallel_rank=2)
    with pytest.raises(FileNotFoundError, match="missing"):
        loaders(data_path=str(tmp_path / "missing"), num_samples=(4, 0, 0))
    assert not list(tmp_path.glob("*.npy")), "nothing was built"


def test_worker_processes_serve_the_same_stream(tmp_path):
    prefix = write_tagged(tmp_path / "corpus", 30)
    args = dict(data_path=prefix, split="1,0,0", num_samples=(32, 0, 0))
    in_process = take(loaders(**args).train, 6)
    with_worker = take(loaders(num_workers=1, **args).train, 6)
    assert all(torch.equal(a, b) for a, b in zip(in_process, with_worker))
