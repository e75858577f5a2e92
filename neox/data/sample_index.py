"""Index math for packed GPT samples: document order, sample boundaries, sample order (pure numpy).

The token stream of a dataset is its documents, each epoch in a fresh seeded order, laid end to end.
Sample i is the window of `seq_length + 1` tokens starting at token `i * seq_length` of that stream:
consecutive samples overlap by one token, because inputs and labels are the window shifted by one.
Windows run across document boundaries, so no token is dropped for padding.

Three arrays describe it (Megatron's layout, so the files mean the same thing to a reader of either):
    doc_idx      [num_epochs * num_documents]  document ids in stream order
    sample_idx   [num_samples + 1, 2]          (position in doc_idx, token offset) of sample i's
                                               first token; row i + 1 is also sample i's last token
    shuffle_idx  [num_samples]                 the order samples are served in
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max


class SampleIndex(NamedTuple):
    """The three arrays that turn a token stream into shuffled fixed-length samples."""

    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose stream holds `num_samples` windows of `seq_length + 1` tokens."""
    if tokens_per_epoch <= 0:
        raise ValueError("the documents hold no tokens; cannot build samples from empty data")
    # n epochs give (n * tokens - 1) // seq_length samples: the last token cannot start a window.
    return max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """Documents repeated `num_epochs` times, each epoch in its own random order."""
    documents = np.asarray(documents)
    dtype = np.int32 if documents.size == 0 or documents.max() <= _INT32_MAX else np.int64
    out = np.empty(num_epochs * len(documents), dtype=dtype)
    for epoch in range(num_epochs):
        # Shuffling each epoch separately means every document is seen once before any twice.
        out[epoch * len(documents) : (epoch + 1) * len(documents)] = rng.permutation(documents)
    return out


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int) -> np.ndarray:
    """Start (position in doc_idx, offset) of every full window in the stream, plus one end row."""
    doc_sizes = np.asarray(sizes)[doc_idx].astype(np.int64)
    starts = np.zeros(len(doc_sizes) + 1, dtype=np.int64)
    np.cumsum(doc_sizes, out=starts[1:])
    total = int(starts[-1])
    num_samples = (total - 1) // seq_length if total > 0 else 0
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" lands on the last document starting at or before the position, which skips
    # empty documents (several equal starts) and never points past the end of a document.
    doc = np.searchsorted(starts, positions, side="right") - 1
    offset = positions - starts[doc]
    fits32 = len(doc_idx) <= _INT32_MAX and (offset.size == 0 or offset.max() <= _INT32_MAX)
    out = np.empty((num_samples + 1, 2), dtype=np.int32 if fits32 else np.int64)
    out[:, 0] = doc
    out[:, 1] = offset
    return out


def build_shuffle_idx(num_samples: int, rng: np.random.RandomState) -> np.ndarray:
    """A random permutation of range(num_samples)."""
    dtype = np.uint32 if num_samples < np.iinfo(np.uint32).max else np.int64
    order = np.arange(num_samples, dtype=dtype)
    rng.shuffle(order)
    return order


def build_sample_index(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> SampleIndex:
    """Index enough epochs of `documents` for `num_samples` samples, shuffled by `seed`."""
    if seq_length < 1:
        raise ValueError(f"seq_length must be at least 1, got {seq_length}")
    documents = np.asarray(documents)
    if documents.size == 0:
        raise ValueError("no documents to build samples from")
    tokens_per_epoch = int(np.asarray(sizes)[documents].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    # One generator drawn in a fixed order makes the index a pure function of the seed.
    rng = np.random.RandomState(seed)
    doc_idx = build_doc_idx(documents, num_epochs, rng)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length)
    shuffle_idx = build_shuffle_idx(len(sample_idx) - 1, rng)
    return SampleIndex(doc_idx, sample_idx, shuffle_idx)


PACK_IMPLS = ("packed", "pack_until_overflow", "unpacked")


def build_document_sample_index(
    sizes: np.ndarray,
    documents: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    pack_impl: str,
    keep: np.ndarray | None = None,
) -> SampleIndex:
    """Samples of whole documents, gpt-neox's "unpacked" and "pack_until_overflow".

    unpacked: each sample is one document. pack_until_overflow: documents are laid into a
    sample until the next one would overflow its `seq_length + 1` tokens; that one starts the
    next sample. Sample i holds documents doc_idx[sample_idx[i, 0]:sample_idx[i + 1, 0]] (the
    offsets are 0): the reader cuts a longer document and pads a shorter sample. Each epoch
    takes the documents in a fresh seeded order, as `build_doc_idx` does.

    Args:
        keep: per entry of `documents`, whether it may be drawn (documents too long to be cut,
            or with no trained token, are left out); None keeps every one.
    """
    if pack_impl not in PACK_IMPLS[1:]:
        raise ValueError(f"pack_impl={pack_impl!r} is not a whole-document packing")
    documents = np.asarray(documents)
    if keep is not None:
        documents = documents[np.asarray(keep, dtype=bool)]
    if documents.size == 0:
        raise ValueError("no documents to build samples from")
    lengths = np.minimum(np.asarray(sizes)[documents].astype(np.int64), seq_length + 1)
    rng = np.random.RandomState(seed)
    order_chunks: list[np.ndarray] = []
    starts: list[int] = []  # position in the stream (doc_idx) where each sample begins
    stream, running = 0, 0
    # One start past the last sample marks its end: num_samples + 1 starts are needed.
    while len(starts) <= num_samples:
        perm = rng.permutation(len(documents))
        order_chunks.append(documents[perm])
        if pack_impl == "unpacked":
            starts.extend(range(stream, stream + len(perm)))
        else:
            for pos, n in enumerate(lengths[perm].tolist()):
                if running == 0 or running + n > seq_length + 1:
                    starts.append(stream + pos)
                    running = n
                else:
                    running += n
        stream += len(perm)
    starts = starts[: num_samples + 1]
    doc_idx = np.concatenate(order_chunks)[: starts[-1]]
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_idx[:, 0] = starts
    shuffle_idx = build_shuffle_idx(num_samples, rng)
    return SampleIndex(doc_idx.astype(np.int64), sample_idx, shuffle_idx)
