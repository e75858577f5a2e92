"""Preference data: one document per sample, never packed, with its labels and pair or reward.

DPO and reward models read chosen/rejected pairs: document i of pos_<split>_data_paths and
document i of neg_<split>_data_paths are one pair (`preprocess_data_with_chat_template.py
--jsonl-keys chosen rejected` writes both sides from the same JSON lines, in order). KTO reads
single answers of <split>_data_paths with a reward per document (<split>_reward_data_paths;
its sign says desirable or undesirable). Label files (<prefix>_label_document, as that tool
writes them) hold the token where it is trained and -100 where it is masked; without one every
token of the document is trained.

A sample is a document cut or padded to seq_length + 1 tokens (token 0 and label -100 pad), as
gpt-neox's `pack_impl: unpacked` makes it; allow_chopped: false skips documents that would be
cut (in a pair, when either side would). Documents whose labels are all -100 within the window
are skipped too: they would train nothing. Samples run through the kept documents in an order
shuffled anew each epoch from the seed, so every rank computes the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from neox.config.schema import NeoXConfig
from neox.data.indexed import IndexedDataset
from neox.data.loader import DataLoaders, ReadPlan, sampled_loaders

log = logging.getLogger(__name__)

IGNORE = -100  # the label of a masked token, as gpt-neox's tools write it


class PreferenceDataError(ValueError):
    """Preference data that cannot be read as configured: the message names files and fix."""


class _Documents:
    """Documents of several .bin/.idx prefixes, numbered across them in order."""

    def __init__(self, prefixes: Sequence[str]) -> None:
        self.prefixes = list(prefixes)
        self.datasets = [IndexedDataset(p) for p in self.prefixes]
        counts = [d.num_documents for d in self.datasets]
        self.starts = np.cumsum([0, *counts])
        self.counts = counts
        # Tokens per document, all prefixes back to back (documents may span sequences).
        self.lengths = np.concatenate(
            [np.zeros(0, dtype=np.int64)]
            + [
                np.diff(np.concatenate([[0], np.cumsum(d.sizes, dtype=np.int64)])[d.doc_idx])
                for d in self.datasets
            ]
        )

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, doc: int) -> tuple[IndexedDataset, int]:
        which = int(np.searchsorted(self.starts, doc, side="right")) - 1
        return self.datasets[which], doc - int(self.starts[which])

    def length(self, doc: int) -> int:
        return int(self.lengths[doc])

    def get(self, doc: int, limit: int) -> np.ndarray:
        """The document's first `limit` values."""
        ds, d = self.locate(doc)
        parts, n = [], 0
        for seq in range(int(ds.doc_idx[d]), int(ds.doc_idx[d + 1])):
            if n >= limit:
                break
            part = ds.get(seq, length=min(int(ds.sizes[seq]), limit - n))
            parts.append(part)
            n += len(part)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def __getstate__(self) -> list[str]:
        return self.prefixes

    def __setstate__(self, prefixes: list[str]) -> None:
        self.__init__(prefixes)


def _same_documents(a: _Documents, b: _Documents, what: str) -> None:
    """Two sides that must line up document for document (data and its labels, or a pair)."""
    if a.counts != b.counts:
        raise PreferenceDataError(
            f"{what}: {a.prefixes} hold {a.counts} documents but {b.prefixes} hold {b.counts}; "
            "they must line up one for one (write both from the same JSON lines with "
            "preprocess_data_with_chat_template.py)"
        )


def _window(values: np.ndarray, width: int, pad: int) -> np.ndarray:
    out = np.full(width, pad, dtype=np.int64)
    n = min(width, len(values))
    out[:n] = values[:n]
    return out


@dataclass
class Side:
    """One column of samples: tokens and, if given, their label files."""

    tokens: _Documents
    labels: Optional[_Documents]

    @classmethod
    def open(cls, paths: Sequence[str], label_paths: Optional[Sequence[str]], what: str) -> Side:
        tokens = _Documents(paths)
        labels = _Documents(label_paths) if label_paths else None
        if labels is not None:
            _same_documents(tokens, labels, f"{what} and its labels")
            differ = np.flatnonzero(tokens.lengths != labels.lengths)
            if differ.size:
                doc = int(differ[0])
                raise PreferenceDataError(
                    f"{what}: document {doc} has {tokens.length(doc)} tokens but "
                    f"{labels.length(doc)} labels; re-run the preprocessing of both"
                )
        return cls(tokens, labels)

    def sample(self, doc: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, labels) of one document, width long; labels -100 where not trained."""
        tokens = self.tokens.get(doc, width)
        labels = tokens if self.labels is None else self.labels.get(doc, width)
        return _window(tokens, width, 0), _window(labels, width, IGNORE)

    def trains_something(self, doc: int, width: int) -> bool:
        if self.labels is None:
            return self.tokens.length(doc) >= 2
        # The first label has no prediction (it is an input only), as in gpt-neox.
        return bool((self.labels.get(doc, width)[1:] >= 0).any())


class PreferenceDataset(torch.utils.data.Dataset):
    """`num_samples` samples of whole documents (see the module docstring).

    `sides` maps a name ("chosen", "rejected", or "text") to its Side; all sides have the same
    documents. `rewards` (KTO) gives one number per document, read from its file's first value.
    """

    def __init__(
        self,
        sides: dict[str, Side],
        num_samples: int,
        seq_length: int,
        seed: int,
        allow_chopped: bool = True,
        rewards: Optional[_Documents] = None,
        name: str = "train",
    ) -> None:
        first = next(iter(sides.values()))
        for key, side in sides.items():
            _same_documents(first.tokens, side.tokens, f"{name} data ({key})")
        if rewards is not None:
            _same_documents(first.tokens, rewards, f"{name} data and its rewards")
        self.sides, self.rewards = sides, rewards
        self.width = seq_length + 1
        self.seed, self.num_samples = seed, num_samples
        kept, chopped, empty = [], 0, 0
        longest = np.max([s.tokens.lengths for s in sides.values()], axis=0)
        for doc in range(len(first.tokens)):
            if longest[doc] > self.width and not allow_chopped:
                chopped += 1
                continue
            if not all(s.trains_something(doc, self.width) for s in sides.values()):
                empty += 1
                continue
            kept.append(doc)
        if not kept:
            raise PreferenceDataError(
                f"{name} data {first.tokens.prefixes}: no document is usable ({chopped} longer "
                f"than seq_length + 1 = {self.width} with allow_chopped: false, {empty} with no "
                "trained token); raise seq_length or set allow_chopped: true"
            )
        if chopped or empty:
            log.warning(
                "%s preference data: skipped %d documents longer than %d tokens (allow_chopped: "
                "false) and %d with no trained token; %d remain",
                name,
                chopped,
                self.width,
                empty,
                len(kept),
            )
        self.docs = np.asarray(kept, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def document(self, idx: int) -> int:
        """The document sample `idx` reads: epoch by epoch, each a fresh shuffle."""
        epoch, pos = divmod(idx, len(self.docs))
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
        return int(self.docs[order[pos]])

    def __getitem__(self, idx: int) -> dict[str, Any]:
        doc = self.document(idx)
        out: dict[str, Any] = {}
        for key, side in self.sides.items():
            out[key], out[f"{key}_label"] = side.sample(doc, self.width)
        if self.rewards is not None:
            out["reward"] = np.float32(self.rewards.get(doc, 1)[0])
        return out


# Per split, each side's (data, labels) config keys: pairs for DPO/RM, single answers for KTO.
PAIRED_KEYS = {
    "train": {
        "chosen": ("pos_train_data_paths", "pos_train_label_data_paths"),
        "rejected": ("neg_train_data_paths", "neg_train_label_data_paths"),
    },
    "valid": {
        "chosen": ("pos_valid_data_paths", "pos_valid_label_data_paths"),
        "rejected": ("neg_valid_data_paths", "neg_valid_label_data_paths"),
    },
    "test": {
        "chosen": ("pos_test_data_paths", "pos_test_label_data_paths"),
        "rejected": ("neg_test_data_paths", "neg_test_label_data_paths"),
    },
}
REWARDED_KEYS = {
    "train": {"text": ("train_data_paths", "train_label_data_paths")},
    "valid": {"text": ("valid_data_paths", "valid_label_data_paths")},
    "test": {"text": ("test_data_paths", "test_label_data_paths")},
}
REWARD_KEYS = {
    "train": "train_reward_data_paths",
    "valid": "valid_reward_data_paths",
    "test": "test_reward_data_paths",
}


def _key(cfg: Any, key: str) -> Optional[list[str]]:
    """A key of the preference group, else of the data group."""
    group = cfg.preference if key in type(cfg.preference).model_fields else cfg.data
    return getattr(group, key)


def build_preference_dataset(
    cfg: Any, split: str, num_samples: int, seed: int
) -> Optional[PreferenceDataset]:
    """The dataset of one split for cfg's train_impl (None when the split has no data or no
    samples are asked of it). `cfg` is a NeoXConfig."""
    impl = cfg.preference.train_impl
    paired = impl in ("dpo", "rm")
    keys = (PAIRED_KEYS if paired else REWARDED_KEYS)[split]
    if num_samples <= 0 or not _key(cfg, next(iter(keys.values()))[0]):
        return None
    sides = {
        name: Side.open(_key(cfg, data), _key(cfg, labels), f"{split} {name} ({data})")
        for name, (data, labels) in keys.items()
    }
    rewards = None
    if impl == "kto":
        rewards = _Documents(_key(cfg, REWARD_KEYS[split]))
    return PreferenceDataset(
        sides,
        num_samples,
        cfg.model.seq_length,
        seed,
        allow_chopped=cfg.data.allow_chopped,
        rewards=rewards,
        name=split,
    )


def build_preference_loaders(cfg: NeoXConfig, read: ReadPlan) -> DataLoaders:
    """DataLoaders of preference samples for cfg, resumable at the consumed counts exactly as the
    language-model streams are."""
    datasets = [
        build_preference_dataset(cfg, split, n, cfg.training.seed)
        for split, n in zip(("train", "valid", "test"), read.num_samples)
    ]
    return sampled_loaders(datasets, read, cfg.data.num_workers)
