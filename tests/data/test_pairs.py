"""Preference samples: pairs aligned document for document, labels padded with -100, documents
chopped or skipped by allow_chopped, and misaligned files refused by name."""

import itertools

import numpy as np
import pytest
import torch

from neox.config import load_dict
from neox.data.indexed import IndexedDatasetBuilder
from neox.data.loader import ReadPlan
from neox.data.pairs import (
    IGNORE,
    PreferenceDataError,
    PreferenceDataset,
    Side,
    _Documents,
    build_preference_loaders,
)
from tests.preference_helpers import PROMPT, SEP, pair_keys, write_pairs, write_rewarded


def write(prefix, docs):
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.int32)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def pairs(tmp_path, n=10, seq_length=16, **kw):
    keys = write_pairs(tmp_path, "train", n)
    sides = {
        "chosen": Side.open([keys["pos_data"]], [keys["pos_label_data"]], "chosen"),
        "rejected": Side.open([keys["neg_data"]], [keys["neg_label_data"]], "rejected"),
    }
    return PreferenceDataset(sides, 3 * n, seq_length, seed=7, **kw)


def test_chosen_and_rejected_of_a_sample_share_their_prompt(tmp_path):
    data = pairs(tmp_path)
    seen = set()
    for i in range(len(data)):
        s = data[i]
        c, r = s["chosen"], s["rejected"]
        assert c.shape == r.shape == (17,)
        assert (c[: PROMPT + 1] == r[: PROMPT + 1]).all() and c[PROMPT] == SEP
        assert c[PROMPT + 1] == c[PROMPT - 1] != r[PROMPT + 1]  # the rule: repeat the last token
        # Prompt masked, answer and EOD trained, padding masked.
        labels = s["chosen_label"]
        assert (labels[: PROMPT + 1] == IGNORE).all() and (labels[PROMPT + 3 :] == IGNORE).all()
        assert (labels[PROMPT + 1 : PROMPT + 3] == c[PROMPT + 1 : PROMPT + 3]).all()
        seen.add(data.document(i))
    assert seen == set(range(10))  # every epoch visits every document
    assert [data.document(i) for i in range(10)] != list(range(10))  # shuffled
    assert sorted(data.document(i) for i in range(10, 20)) == list(range(10))


def test_sample_order_is_a_function_of_the_seed(tmp_path):
    a, b = pairs(tmp_path), pairs(tmp_path)
    assert [a.document(i) for i in range(30)] == [b.document(i) for i in range(30)]


def test_long_documents_are_chopped_or_skipped(tmp_path):
    long_doc, short = list(range(1, 30)), [1, 2, 3]
    chosen = write(tmp_path / "c", [long_doc, short])
    rejected = write(tmp_path / "r", [short, short])
    sides = {"chosen": Side.open([chosen], None, "c"), "rejected": Side.open([rejected], None, "r")}
    chopped = PreferenceDataset(sides, 4, 8, seed=0, allow_chopped=True)
    assert chopped.docs.tolist() == [0, 1]
    i = [chopped.document(k) for k in range(2)].index(0)
    assert chopped[i]["chosen"].tolist() == long_doc[:9]
    # Without labels every real token trains, padding does not.
    j = 1 - i
    assert chopped[j]["chosen_label"].tolist() == short + [IGNORE] * 6
    skipped = PreferenceDataset(sides, 4, 8, seed=0, allow_chopped=False)
    assert skipped.docs.tolist() == [1]  # the pair goes when either side is too long
    with pytest.raises(PreferenceDataError, match="raise seq_length or set allow_chopped"):
        only_long = {"chosen": Side.open([write(tmp_path / "l", [long_doc])], None, "l")}
        PreferenceDataset(only_long, 4, 8, seed=0, allow_chopped=False)


def test_misaligned_files_are_refused_naming_them(tmp_path):
    chosen = write(tmp_path / "c", [[1, 2], [3, 4]])
    rejected = write(tmp_path / "r", [[1, 2]])
    sides = {"chosen": Side.open([chosen], None, "c"), "rejected": Side.open([rejected], None, "r")}
    with pytest.raises(PreferenceDataError, match=r"hold \[2\] documents .* hold \[1\]"):
        PreferenceDataset(sides, 4, 8, seed=0)
    labels = write(tmp_path / "cl", [[1, 2], [3, 4, 5]])
    with pytest.raises(PreferenceDataError, match="document 1 has 2 tokens but 3 labels"):
        Side.open([chosen], [labels], "c")


def test_kto_samples_carry_their_reward(tmp_path):
    keys = write_rewarded(tmp_path, "train", 6)
    side = Side.open([keys["data"]], [keys["label_data"]], "text")
    data = PreferenceDataset(
        {"text": side}, 6, 16, seed=0, rewards=_Documents([keys["reward_data"]])
    )
    rewards = {data.document(i): float(data[i]["reward"]) for i in range(6)}
    assert rewards == {d: (1.0 if d % 2 == 0 else -1.0) for d in range(6)}


def test_documents_number_on_across_prefixes(tmp_path):
    """pos_ path i pairs with neg_ path i (gpt-neox's lists), documents numbered on across them."""
    chosen = [write(tmp_path / "c1", [[1, 2], [3, 4, 5]]), write(tmp_path / "c2", [[6, 7, 8, 9]])]
    rejected = [write(tmp_path / "r1", [[1, 9], [3, 4, 9]]), write(tmp_path / "r2", [[6, 7, 0]])]
    sides = {"chosen": Side.open(chosen, None, "c"), "rejected": Side.open(rejected, None, "r")}
    data = PreferenceDataset(sides, 3, 8, seed=0)
    firsts = set()
    for i in range(3):
        s = data[i]
        assert s["chosen"][0] == s["rejected"][0]  # the same pair, whichever file it is in
        firsts.add(int(s["chosen"][0]))
    assert firsts == {1, 3, 6}
    assert sides["chosen"].tokens.lengths.tolist() == [2, 3, 4]
    one_file = {
        "chosen": sides["chosen"],
        "rejected": Side.open([write(tmp_path / "r", [[1]] * 3)], None, "r"),
    }
    with pytest.raises(PreferenceDataError, match=r"hold \[2, 1\] documents"):
        PreferenceDataset(one_file, 3, 8, seed=0)


def test_preference_streams_resume_and_split_like_the_language_model_ones(tmp_path):
    cfg = load_dict(
        {
            "seq_length": 16,
            "train_impl": "dpo",
            "dataset_impl": "pairwise",
            "pack_impl": "unpacked",
            "num_workers": 0,
            **pair_keys(tmp_path),
        }
    )

    def chosen(**read):
        loaders = build_preference_loaders(cfg, ReadPlan(num_samples=(16, 0, 0), **read))
        assert loaders.valid is None and loaders.test is None
        return [b["chosen"] for b in itertools.islice(loaders.train, 4)]

    whole = chosen(micro_batch_size=2)
    assert torch.equal(
        torch.cat(chosen(micro_batch_size=2, consumed_train_samples=4)[:2]), torch.cat(whole[2:4])
    )
    ranks = [chosen(micro_batch_size=1, data_parallel_rank=r, data_parallel_size=2) for r in (0, 1)]
    for step in range(2):
        assert torch.equal(torch.cat([ranks[0][step], ranks[1][step]]), whole[step])
