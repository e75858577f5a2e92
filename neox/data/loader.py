"""Build the train/valid/test sample streams: one split data path or blended per-split paths."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from neox.config.data import split_ranges
from neox.config.schema import NeoXConfig
from neox.data.blendable import (
    BlendableDataset,
    normalize_weights,
    samples_per_dataset,
    weights_by_num_documents,
)
from neox.data.gpt_dataset import GPTDataset
from neox.data.indexed import IndexedDataset
from neox.data.samplers import PretrainingSampler

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def split_documents(split: str, num_documents: int) -> list[np.ndarray]:
    """Contiguous document ranges for train, valid and test, sized by the split weights."""
    return [np.arange(a, b, dtype=np.int64) for a, b in split_ranges(split, num_documents)]


@dataclass
class DataLoaders:
    """Endless iterators of collated micro-batches ({"text": int64 [B, seq_length + 1]}, and
    "label" alike with label datasets or whole-document packing) per split.

    A split is None when no samples were requested for it.
    """

    train: Iterator[dict[str, torch.Tensor]] | None
    valid: Iterator[dict[str, torch.Tensor]] | None
    test: Iterator[dict[str, torch.Tensor]] | None
    train_dataset: torch.utils.data.Dataset | None
    valid_dataset: torch.utils.data.Dataset | None
    test_dataset: torch.utils.data.Dataset | None


@dataclass(frozen=True)
class ReadPlan:
    """What one rank reads of each split: the run's values the config's data keys do not hold."""

    num_samples: Sequence[int]
    """Global samples needed per split (train, valid, test), e.g. train_iters x global batch;
    0 skips a split."""
    micro_batch_size: int
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    consumed_train_samples: int = 0
    """Global samples already trained on; the train stream resumes there."""
    consumed_valid_samples: int = 0
    pin_memory: bool = False


def _iterate(loader: torch.utils.data.DataLoader) -> Iterator[dict[str, torch.Tensor]]:
    # A generator starts workers on the first next(), not when the loaders are built.
    yield from loader


def build_split_datasets(
    data_path: str,
    split: str,
    num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    cache_dir: str | None = None,
    use_shared_fs: bool = True,
    label_path: str | None = None,
    pack_impl: str = "packed",
    allow_chopped: bool = True,
    vocab_size: int | None = None,
) -> list[GPTDataset | None]:
    """Train, valid and test datasets over document ranges of one indexed dataset (and of its
    label dataset at `label_path`, cut the same way)."""
    indexed = IndexedDataset(data_path)
    label = IndexedDataset(label_path) if label_path else None
    ranges = split_documents(split, len(indexed.sizes))
    for name, docs, n in zip(SPLIT_NAMES, ranges, num_samples):
        if n > 0 and docs.size == 0:
            raise ValueError(
                f"split {split!r} of {data_path} ({len(indexed.sizes)} documents) gives the {name} "
                f"split no documents, but {n} {name} samples are needed; use more data, raise the "
                f"{name} part of split, or request no {name} samples (eval_iters: 0 for valid)"
            )
    for name, docs in zip(SPLIT_NAMES, ranges):
        logger.info("%s split: %d documents of %s", name, docs.size, data_path)
    packing = dict(label=label, pack_impl=pack_impl, allow_chopped=allow_chopped)
    packing["vocab_size"] = vocab_size
    return [
        GPTDataset(name, indexed, docs, n, seq_length, seed, cache_dir, use_shared_fs, **packing)
        if n > 0
        else None
        for name, docs, n in zip(SPLIT_NAMES, ranges, num_samples)
    ]


def build_blended_dataset(
    name: str,
    paths: Sequence[str],
    weights: Sequence[float] | None,
    num_samples: int,
    seq_length: int,
    seed: int,
    weight_by_num_documents: bool = False,
    weighted_sampler_alpha: float = 1.0,
    cache_dir: str | None = None,
    use_shared_fs: bool = True,
    label_paths: Sequence[str] | None = None,
    pack_impl: str = "packed",
    allow_chopped: bool = True,
    vocab_size: int | None = None,
) -> torch.utils.data.Dataset:
    """One split's dataset: whole indexed datasets at `paths` (with the label datasets at
    `label_paths`, one per path), blended by `weights`."""
    if label_paths and len(label_paths) != len(paths):
        raise ValueError(
            f"{len(paths)} {name}_data_paths but {len(label_paths)} {name}_label_data_paths; "
            "give one label dataset per data path"
        )
    indexed = [IndexedDataset(p) for p in paths]
    labels = [IndexedDataset(p) for p in label_paths] if label_paths else [None] * len(paths)
    packing = dict(pack_impl=pack_impl, allow_chopped=allow_chopped, vocab_size=vocab_size)
    if weight_by_num_documents:
        if weights is not None:
            logger.warning(
                "%s_data_weights %s are replaced by weight_by_num_documents", name, list(weights)
            )
        weights = weights_by_num_documents([len(d.sizes) for d in indexed], weighted_sampler_alpha)
    elif weights is None:
        weights = [1.0] * len(paths)
    if len(weights) != len(paths):
        raise ValueError(
            f"{len(paths)} {name}_data_paths but {len(weights)} {name}_data_weights; give one "
            "weight per path (or none, for equal weights)"
        )
    weights = normalize_weights(weights)
    if len(paths) == 1:
        docs = np.arange(len(indexed[0].sizes))
        return GPTDataset(
            name,
            indexed[0],
            docs,
            num_samples,
            seq_length,
            seed,
            cache_dir,
            use_shared_fs,
            label=labels[0],
            **packing,
        )
    counts = samples_per_dataset(weights, num_samples)
    datasets = [
        GPTDataset(
            f"{name}_{i}",
            d,
            np.arange(len(d.sizes)),
            n,
            seq_length,
            seed,
            cache_dir,
            use_shared_fs,
            label=label,
            **packing,
        )
        for i, (d, label, n) in enumerate(zip(indexed, labels, counts))
        if n > 0
    ]
    return BlendableDataset(datasets, weights[weights > 0], num_samples)


def _check_sources(
    data_path: str | None, split_paths: dict[str, Sequence[str] | None], read: ReadPlan
) -> None:
    # Every mistake in the arguments is reported before any index is built.
    num_samples, rank, size = read.num_samples, read.data_parallel_rank, read.data_parallel_size
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"num_samples must be three non-negative counts, got {num_samples}")
    if read.micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {read.micro_batch_size}")
    if not 0 <= rank < size:
        raise ValueError(f"data_parallel_rank={rank} must lie in [0, {size})")
    given = {name: p for name, p in split_paths.items() if p}
    if data_path and given:
        raise ValueError(
            "give either data_path (with split) or train/valid/test_data_paths, not both"
        )
    if not data_path:
        if not given:
            raise ValueError("no data: set data_path (with split) or train_data_paths")
        for name, n in zip(SPLIT_NAMES, num_samples):
            if n > 0 and name not in given:
                raise ValueError(
                    f"{n} {name} samples are needed but no {name}_data_paths are given; add them "
                    f"or request no {name} samples (eval_iters: 0 for valid and test)"
                )


def build_train_valid_test_loaders(
    cfg: NeoXConfig, read: ReadPlan, vocab_size: int | None = None
) -> DataLoaders:
    """Datasets and endless micro-batch iterators for train, valid and test, from cfg's data
    keys (one `data_path` cut by `split`, or blended per-split paths, their labels, packing and
    cache), its seq_length and seed.

    Args:
        read: what this rank reads of each split (counts, batch, its data-parallel slot, where
            a resumed run goes on).
        vocab_size: the model's token embeddings; a sample with a larger id is an error naming
            its file (None: not checked).
    """
    data, seq_length, seed = cfg.data, cfg.model.seq_length, cfg.training.seed
    num_samples = read.num_samples
    split_paths = {
        "train": data.train_data_paths,
        "valid": data.valid_data_paths,
        "test": data.test_data_paths,
    }
    _check_sources(data.data_path, split_paths, read)
    cache_dir = data.data_cache_dir
    if data.data_path:
        datasets = build_split_datasets(
            data.data_path,
            data.split,
            num_samples,
            seq_length,
            seed,
            cache_dir,
            data.use_shared_fs,
            data.label_data_paths[0] if data.label_data_paths else None,
            data.pack_impl,
            data.allow_chopped,
            vocab_size,
        )
    else:
        label_paths = {
            "train": data.train_label_data_paths,
            "valid": data.valid_label_data_paths,
            "test": data.test_label_data_paths,
        }
        weights = {
            "train": data.train_data_weights,
            "valid": data.valid_data_weights,
            "test": data.test_data_weights,
        }
        datasets = [
            build_blended_dataset(
                name,
                split_paths[name],
                weights[name],
                n,
                seq_length,
                seed,
                data.weight_by_num_documents,
                data.weighted_sampler_alpha,
                cache_dir,
                data.use_shared_fs,
                label_paths[name],
                data.pack_impl,
                data.allow_chopped,
                vocab_size,
            )
            if n > 0
            else None
            for name, n in zip(SPLIT_NAMES, num_samples)
        ]
    return sampled_loaders(datasets, read, data.num_workers)


def sampled_loaders(datasets: Sequence[Any], read: ReadPlan, num_workers: int) -> DataLoaders:
    """DataLoaders over (train, valid, test) datasets (None where a split is empty), each resumed
    after its consumed samples: the one sampler every kind of dataset (language model, preference
    pairs) goes through."""

    def stream(dataset: Any, consumed: int) -> Iterator | None:
        if dataset is None:
            return None
        sampler = PretrainingSampler(
            len(dataset),
            consumed,
            read.micro_batch_size,
            read.data_parallel_rank,
            read.data_parallel_size,
        )
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=read.pin_memory
        )
        return _iterate(loader)

    train, valid, test = datasets
    return DataLoaders(
        train=stream(train, read.consumed_train_samples),
        valid=stream(valid, read.consumed_valid_samples),
        test=stream(test, 0),
        train_dataset=train,
        valid_dataset=valid,
        test_dataset=test,
    )
