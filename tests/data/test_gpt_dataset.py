import os

import numpy as np
import pytest
import torch.multiprocessing as mp

from neox.data.gpt_dataset import GPTDataset
from neox.data.indexed import IndexedDataset, IndexedDatasetBuilder


def write_dataset(prefix, docs, dtype=np.uint16):
    """Write `docs` (lists of token ids) as an indexed dataset and open it."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return IndexedDataset(str(prefix))


def random_docs(n, seed=0, max_len=30, vocab=1000):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, size=rng.randint(1, max_len)) for _ in range(n)]


def test_every_sample_is_a_window_of_the_shuffled_documents(tmp_path):
    docs = random_docs(40)
    indexed = write_dataset(tmp_path / "corpus", docs)
    seq_length = 16
    ds = GPTDataset("train", indexed, np.arange(40), 60, seq_length, seed=5)
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    assert len(ds) >= 60
    seen = set()
    for i in range(len(ds)):
        text = ds[i]["text"]
        assert text.dtype == np.int64 and text.shape == (seq_length + 1,)
        j = int(ds.shuffle_idx[i])
        np.testing.assert_array_equal(
            text, stream[j * seq_length : j * seq_length + seq_length + 1]
        )
        seen.add(j)
    assert seen == set(range(len(ds)))
    assert [int(ds.shuffle_idx[i]) for i in range(10)] != list(range(10)), "served shuffled"


def test_same_seed_same_samples_other_seed_differs(tmp_path):
    indexed = write_dataset(tmp_path / "corpus", random_docs(30))
    a = GPTDataset("train", indexed, np.arange(30), 20, 8, seed=1, cache_dir=str(tmp_path / "a"))
    b = GPTDataset("train", indexed, np.arange(30), 20, 8, seed=1, cache_dir=str(tmp_path / "b"))
    c = GPTDataset("train", indexed, np.arange(30), 20, 8, seed=2, cache_dir=str(tmp_path / "c"))
    assert b.index_built, "separate cache dirs: b built its own index"
    first = np.stack([a[i]["text"] for i in range(20)])
    np.testing.assert_array_equal(first, np.stack([b[i]["text"] for i in range(20)]))
    assert not np.array_equal(first, np.stack([c[i]["text"] for i in range(20)]))


def test_index_is_cached_and_reused_and_rebuilt_when_parameters_change(tmp_path):
    indexed = write_dataset(tmp_path / "corpus", random_docs(30))
    first = GPTDataset("train", indexed, np.arange(30), 20, 8, seed=1)
    assert first.index_built
    # Beside the data by default, and no temporary files left behind.
    assert all(os.path.dirname(p) == str(tmp_path) for p in first.paths.values())
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]
    stamps = {p: os.stat(p).st_mtime_ns for p in first.paths.values()}

    again = GPTDataset("train", indexed, np.arange(30), 20, 8, seed=1)
    assert not again.index_built
    assert again.paths == first.paths
    assert {p: os.stat(p).st_mtime_ns for p in again.paths.values()} == stamps
    np.testing.assert_array_equal(again[3]["text"], first[3]["text"])

    changes = [
        dict(name="valid"),
        dict(num_samples=21),
        dict(seq_length=9),
        dict(seed=2),
        dict(documents=np.arange(29)),
    ]
    for change in changes:
        args = dict(name="train", documents=np.arange(30), num_samples=20, seq_length=8, seed=1)
        args.update(change)
        other = GPTDataset(indexed=indexed, **args)
        assert other.index_built, change
        assert other.paths["shuffle_idx"] != first.paths["shuffle_idx"], change


def test_tiny_data_gets_enough_epochs_for_many_samples(tmp_path):
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]  # 9 tokens in all
    indexed = write_dataset(tmp_path / "tiny", docs)
    ds = GPTDataset("train", indexed, np.arange(3), 500, 32, seed=0)
    assert len(ds) >= 500
    for i in (0, 250, 499):
        text = ds[i]["text"]
        assert len(text) == 33 and set(text.tolist()) <= set(range(1, 10))
    # Each epoch uses every document once, in its own order.
    epochs = np.asarray(ds.doc_idx).reshape(-1, 3)
    assert all(sorted(e) == [0, 1, 2] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1


def test_document_subset_only_reads_those_documents(tmp_path):
    docs = [[d] * 10 for d in range(20)]  # document d is ten copies of token d
    indexed = write_dataset(tmp_path / "corpus", docs)
    ds = GPTDataset("valid", indexed, np.arange(15, 20), 12, 4, seed=0)
    tokens = np.concatenate([ds[i]["text"] for i in range(len(ds))])
    assert set(tokens.tolist()) == set(range(15, 20))


def test_bad_documents_are_refused(tmp_path):
    indexed = write_dataset(tmp_path / "corpus", random_docs(5))
    with pytest.raises(ValueError, match="no documents"):
        GPTDataset("test", indexed, np.arange(0), 5, 4, seed=0)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        GPTDataset("test", indexed, np.arange(3, 7), 5, 4, seed=0)
    one_token = write_dataset(tmp_path / "one", [[7]])
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        GPTDataset("train", one_token, np.arange(1), 5, 4, seed=0)


def _build_on_rank(rank, world, prefix, init_file, out_dir):
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ds = GPTDataset("train", IndexedDataset(prefix), np.arange(30), 25, 8, seed=4)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"built": ds.index_built, "sample": ds[7]["text"].tolist()}, f)
    dist.destroy_process_group()


def test_rank_zero_builds_while_other_ranks_wait(tmp_path):
    import json

    prefix = str(tmp_path / "corpus")
    write_dataset(prefix, random_docs(30))
    # fork: the children share the imported torch instead of importing it again.
    mp.start_processes(
        _build_on_rank,
        args=(2, prefix, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="fork",
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["built"] is True and results[1]["built"] is False
    assert results[0]["sample"] == results[1]["sample"]


def test_samples_of_real_text_are_its_bytes_in_document_order(tmp_path, shared_data):
    # Tiny Shakespeare as bytes, one document per speech (blank-line separated).
    text = (shared_data / "tinyshakespeare.txt").read_bytes()
    speeches = [s + b"\n\n" for s in text.split(b"\n\n")]
    indexed = write_dataset(
        tmp_path / "shakespeare", [np.frombuffer(s, np.uint8) for s in speeches]
    )
    ds = GPTDataset("train", indexed, np.arange(len(speeches)), 2000, 128, seed=0)
    stream = b"".join(speeches[d] for d in ds.doc_idx)
    for i in (0, 1, 999, 1999):
        j = int(ds.shuffle_idx[i])
        assert bytes(ds[i]["text"].astype(np.uint8)) == stream[j * 128 : j * 128 + 129]


def labelled(docs, rng):
    """Label documents for `docs`: each token id where trained, -100 where not (a random
    prompt length, and a few documents with nothing trained at all)."""
    out = []
    for i, doc in enumerate(docs):
        label = np.asarray(doc, dtype=np.int64).copy()
        cut = rng.randint(0, len(doc) + 1) if i % 7 else len(doc)
        label[:cut] = -100
        out.append(label)
    return out


def test_packed_label_windows_are_aligned_with_the_token_windows(tmp_path):
    docs = random_docs(40, seed=3)
    indexed = write_dataset(tmp_path / "text", docs)
    labels = write_dataset(tmp_path / "label", labelled(docs, np.random.RandomState(0)), np.int32)
    ds = GPTDataset("train", indexed, np.arange(40), 30, 16, seed=5, label=labels)
    for i in range(30):
        item = ds[i]
        text, label = item["text"], item["label"]
        assert label.shape == text.shape and label.dtype == np.int64
        trained = label >= 0
        np.testing.assert_array_equal(label[trained], text[trained])
        assert set(np.unique(label[~trained]).tolist()) <= {-100}
    # Without labels the items are exactly the pretraining ones.
    plain = GPTDataset("train", indexed, np.arange(40), 30, 16, seed=5)
    np.testing.assert_array_equal(plain[3]["text"], ds[3]["text"])
    assert "label" not in plain[3]


def test_a_label_dataset_of_other_document_lengths_is_refused_naming_both(tmp_path):
    docs = random_docs(10, seed=4)
    indexed = write_dataset(tmp_path / "text", docs)
    wrong = write_dataset(tmp_path / "label", [d[:-1] if len(d) > 1 else d for d in docs])
    with pytest.raises(
        ValueError, match=r"label\.bin/\.idx does not match its text dataset .*text"
    ):
        GPTDataset("train", indexed, np.arange(10), 5, 8, seed=1, label=wrong)


@pytest.mark.parametrize("pack_impl", ["unpacked", "pack_until_overflow"])
def test_whole_document_samples_pad_and_never_train_the_padding(tmp_path, pack_impl):
    docs = random_docs(30, seed=6, max_len=14, vocab=500)
    docs[4] = np.arange(1, 40)  # longer than a sample: cut to its start
    indexed = write_dataset(tmp_path / "text", docs)
    labels = write_dataset(tmp_path / "label", labelled(docs, np.random.RandomState(1)), np.int32)
    seq = 16
    ds = GPTDataset(
        "train", indexed, np.arange(30), 50, seq, seed=2, label=labels, pack_impl=pack_impl
    )
    assert len(ds) == 50
    for i in range(len(ds)):
        sample = int(ds.shuffle_idx[i])
        members = ds.doc_idx[ds.sample_idx[sample][0] : ds.sample_idx[sample + 1][0]]
        text, label = ds[i]["text"], ds[i]["label"]
        assert text.shape == label.shape == (seq + 1,)
        whole = np.concatenate([docs[d] for d in members])[: seq + 1]
        np.testing.assert_array_equal(text[: len(whole)], whole)
        assert (text[len(whole) :] == 0).all() and (label[len(whole) :] == -100).all()
        if pack_impl == "unpacked":
            assert len(members) == 1
        else:  # whole documents until the next would overflow
            sizes = [len(docs[d]) for d in members]
            assert len(members) == 1 or sum(sizes) <= seq + 1
        # Documents with nothing trained are never drawn (every 7th has none).
        assert all(int(d) % 7 for d in members)


def test_allow_chopped_false_leaves_long_documents_out(tmp_path):
    docs = [np.arange(1, 6), np.arange(1, 40), np.arange(7, 12)]
    indexed = write_dataset(tmp_path / "text", docs)
    ds = GPTDataset(
        "train", indexed, np.arange(3), 10, 8, seed=0, pack_impl="unpacked", allow_chopped=False
    )
    assert 1 not in set(ds.doc_idx.tolist())
    # Without a label dataset, the label window is the text with its padding masked.
    item = ds[0]
    n = int((item["label"] >= 0).sum())
    np.testing.assert_array_equal(item["label"][:n], item["text"][:n])
    assert n == 5


@pytest.mark.parametrize("pack_impl", ["packed", "unpacked"])
def test_a_token_beyond_the_vocabulary_is_named_with_its_file(tmp_path, pack_impl):
    """Issue 33 (defect 8): one id at or above the model's vocabulary (a sparse one in a large
    file can pass preflight's sampled scan) crashed mid-run naming neither file nor id."""
    docs = [[1, 2, 3, 4, 5, 0]] * 9 + [[1, 2, 60000, 4, 5, 0]]
    indexed = write_dataset(tmp_path / "corpus", docs)
    ds = GPTDataset("train", indexed, np.arange(10), 20, 4, seed=0, vocab_size=512,
                    pack_impl=pack_impl)  # fmt: skip
    with pytest.raises(ValueError) as e:
        for i in range(len(ds)):
            ds[i]
    assert f"{tmp_path / 'corpus'}.bin" in str(e.value) and "token id 60000" in str(e.value)
    assert "512" in str(e.value)
    fine = GPTDataset("valid", indexed, np.arange(9), 20, 4, seed=0, vocab_size=512)
    assert all(fine[i]["text"].max() < 512 for i in range(len(fine)))
