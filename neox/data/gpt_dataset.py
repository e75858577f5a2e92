"""GPT dataset: fixed-length token windows over shuffled documents, index cached on disk.

With a label dataset (gpt-neox's label_data_paths, written by tools/preprocess_data_with_*.py)
each sample also carries the label window aligned with its tokens: the token id where trained,
-100 where not. `pack_impl` chooses how documents fill samples (gpt-neox's meanings): "packed"
windows run across documents; "pack_until_overflow" puts whole documents into a sample until
the next would overflow it; "unpacked" gives each document a sample of its own. The last two
pad a sample to seq_length + 1 tokens, and the padding is never trained (label -100).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import numpy as np
import torch

from neox.data.indexed import IGNORE_INDEX, IndexedDataset, check_label_dataset
from neox.data.sample_index import (
    PACK_IMPLS,
    SampleIndex,
    build_document_sample_index,
    build_sample_index,
)

logger = logging.getLogger(__name__)

# Bump when the index layout or the way it is drawn from the seed changes, so old files are not reused.
INDEX_VERSION = 1
_KINDS = ("doc_idx", "sample_idx", "shuffle_idx")


def index_cache_paths(
    data_prefix: str,
    name: str,
    documents: np.ndarray,
    sizes: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    cache_dir: str | None = None,
    packing: dict | None = None,
) -> dict[str, str]:
    """Paths of the three index files for these parameters (a hash of all of them in the name).

    Args:
        packing: what else shapes a whole-document index (pack_impl, allow_chopped, the label
            dataset that decides which documents hold trained tokens); None for "packed".
    """
    documents = np.ascontiguousarray(documents, dtype=np.int64)
    key = {
        "version": INDEX_VERSION,
        "name": name,
        "prefix": os.path.basename(data_prefix),
        # The dataset's shape and the chosen documents: a rebuilt dataset or new split gets new files.
        "num_sequences": int(len(sizes)),
        "num_tokens": int(np.asarray(sizes).sum(dtype=np.int64)),
        "documents": hashlib.sha1(documents.tobytes()).hexdigest(),
        "num_samples": int(num_samples),
        "seq_length": int(seq_length),
        "seed": int(seed),
    }
    if packing:
        key["packing"] = packing
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_dir if cache_dir is not None else os.path.dirname(os.path.abspath(data_prefix))
    stem = os.path.join(folder, f"{os.path.basename(data_prefix)}_{name}_{digest}")
    return {kind: f"{stem}_{kind}.npy" for kind in _KINDS}


def _save_atomic(path: str, array: np.ndarray) -> None:
    # A reader never sees a half-written file: the name appears only once the data is complete.
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def _is_builder(use_shared_fs: bool) -> bool:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return True
    if use_shared_fs:
        return dist.get_rank() == 0
    # Each node has its own disk: its first local process builds for the node.
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


def _barrier() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def load_or_build_index(
    paths: dict[str, str],
    sizes: np.ndarray,
    documents: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    use_shared_fs: bool = True,
    build=None,
) -> tuple[SampleIndex, bool]:
    """Load the cached index at `paths`, building it first (one process) when missing.

    Every rank must call this when torch.distributed is initialised (it holds a barrier).
    Returns the memory-mapped index and whether this process built it.

    Args:
        build: makes the index when missing (default: build_sample_index's packed windows).
    """
    built = False
    if _is_builder(use_shared_fs) and not all(os.path.isfile(p) for p in paths.values()):
        folder = os.path.dirname(paths["doc_idx"])
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            raise OSError(
                f"cannot create the index cache folder {folder} ({err}); "
                "pass a writable cache_dir (data cache_dir in the config)"
            ) from err
        start = time.perf_counter()
        if build is None:
            index = build_sample_index(sizes, documents, num_samples, seq_length, seed)
        else:
            index = build()
        # shuffle_idx is written last; the loader below requires all three.
        for kind in _KINDS:
            _save_atomic(paths[kind], getattr(index, kind))
        built = True
        logger.info(
            "built sample index %s (%d samples, %d documents in stream) in %.2fs",
            paths["shuffle_idx"],
            len(index.shuffle_idx),
            len(index.doc_idx),
            time.perf_counter() - start,
        )
    _barrier()
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f"sample index files {missing} are missing after the building rank finished; if the "
            "cache folder is not shared by all nodes, set use_shared_fs false"
        )
    loaded = SampleIndex(*(np.load(paths[kind], mmap_mode="r") for kind in _KINDS))
    return loaded, built


def trainable_documents(
    label: IndexedDataset, documents: np.ndarray, seq_length: int
) -> np.ndarray:
    """Per document, whether any label of its first sample (seq_length + 1 tokens) is trained."""
    out = np.zeros(len(documents), dtype=bool)
    for i, doc in enumerate(np.asarray(documents).tolist()):
        n = min(int(label.sizes[doc]), seq_length + 1)
        # Position 0 is never a target: labels are the window shifted by one.
        out[i] = n > 1 and bool((label.get(doc, 1, n - 1) >= 0).any())
    return out


class GPTDataset(torch.utils.data.Dataset):
    """Samples of `seq_length + 1` tokens over `documents` of an indexed dataset.

    Its length is every sample of the indexed epochs, at least `num_samples`.
    Each item is {"text": np.int64 array of seq_length + 1 tokens}, plus "label" (aligned with
    "text", -100 where not trained) with a label dataset or whole-document packing.
    """

    def __init__(
        self,
        name: str,
        indexed: IndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | None = None,
        use_shared_fs: bool = True,
        label: IndexedDataset | None = None,
        pack_impl: str = "packed",
        allow_chopped: bool = True,
        vocab_size: int | None = None,
    ):
        documents = np.asarray(documents)
        if pack_impl not in PACK_IMPLS:
            raise ValueError(f"pack_impl={pack_impl!r} must be one of {', '.join(PACK_IMPLS)}")
        if documents.size == 0:
            raise ValueError(f"{name} dataset from {indexed.prefix} has no documents")
        if documents.min() < 0 or documents.max() >= len(indexed.sizes):
            raise ValueError(
                f"{name} documents must lie in [0, {len(indexed.sizes)}) for {indexed.prefix}"
            )
        if int(indexed.sizes[documents].sum(dtype=np.int64)) < 2:
            raise ValueError(
                f"{name} dataset from {indexed.prefix} holds fewer than 2 tokens in its "
                f"{documents.size} documents; a sample needs at least an input and a label"
            )
        if label is not None:
            check_label_dataset(indexed, label)
        self.name = name
        self.indexed = indexed
        self.label = label
        self.seq_length = seq_length
        self.pack_impl = pack_impl
        # The model's embedding rows: a larger id would fail inside it, naming no file.
        self.vocab_size = vocab_size
        packing, build = None, None
        if pack_impl != "packed":
            packing = {"pack_impl": pack_impl, "allow_chopped": bool(allow_chopped)}
            if label is not None:
                packing["label"] = [os.path.basename(label.prefix), int(label.num_tokens)]

            def build() -> SampleIndex:
                keep = np.ones(len(documents), dtype=bool)
                if not allow_chopped:
                    keep &= indexed.sizes[documents] <= seq_length + 1
                if label is not None:
                    keep &= trainable_documents(label, documents, seq_length)
                if not keep.any():
                    raise ValueError(
                        f"{name} dataset {indexed.prefix}: none of its {documents.size} "
                        f"documents can be drawn with pack_impl={pack_impl} (every one is "
                        f"longer than seq_length + 1 = {seq_length + 1} tokens with "
                        "allow_chopped false, or has no trained label); check the data"
                    )
                return build_document_sample_index(
                    indexed.sizes, documents, num_samples, seq_length, seed, pack_impl, keep
                )

        self.paths = index_cache_paths(
            indexed.prefix,
            name,
            documents,
            indexed.sizes,
            num_samples,
            seq_length,
            seed,
            cache_dir,
            packing,
        )
        index, self.index_built = load_or_build_index(
            self.paths,
            indexed.sizes,
            documents,
            num_samples,
            seq_length,
            seed,
            use_shared_fs,
            build,
        )
        self.doc_idx, self.sample_idx, self.shuffle_idx = index
        if len(self.shuffle_idx) < num_samples:
            raise RuntimeError(
                f"{name} index {self.paths['shuffle_idx']} has {len(self.shuffle_idx)} samples, "
                f"fewer than the {num_samples} requested; delete the file to rebuild it"
            )

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def tokens(self, sample: int, dataset: IndexedDataset | None = None) -> np.ndarray:
        """Tokens of packed sample `sample` in stream order (before shuffling), from `dataset`
        (default: the text; the label dataset gives the aligned labels)."""
        first_doc, first_offset = (int(v) for v in self.sample_idx[sample])
        last_doc, last_offset = (int(v) for v in self.sample_idx[sample + 1])
        get = (dataset or self.indexed).get
        if first_doc == last_doc:
            return get(int(self.doc_idx[first_doc]), first_offset, last_offset - first_offset + 1)
        parts = [get(int(self.doc_idx[first_doc]), first_offset)]
        parts += [get(int(self.doc_idx[d])) for d in range(first_doc + 1, last_doc)]
        parts.append(get(int(self.doc_idx[last_doc]), 0, last_offset + 1))
        return np.concatenate(parts)

    def whole_documents(self, sample: int, dataset: IndexedDataset) -> np.ndarray:
        """A whole-document sample's documents end to end, cut to seq_length + 1 tokens."""
        first, last = int(self.sample_idx[sample][0]), int(self.sample_idx[sample + 1][0])
        parts = [dataset.get(int(d)) for d in self.doc_idx[first:last]]
        return np.concatenate(parts)[: self.seq_length + 1]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.name} with {len(self)} samples")
        sample = int(self.shuffle_idx[idx])
        if self.pack_impl != "packed":
            return self._check_ids(self._padded(sample), idx)
        text = self.tokens(sample).astype(np.int64)
        # Holds by construction of sample_idx; a mismatch means a stale or foreign index file.
        if len(text) != self.seq_length + 1:
            raise RuntimeError(
                f"{self.name} sample {idx} has {len(text)} tokens, expected {self.seq_length + 1}; "
                f"the index {self.paths['sample_idx']} does not match the data, delete it to rebuild"
            )
        if self.label is None:
            return self._check_ids({"text": text}, idx)
        label = self.tokens(sample, self.label).astype(np.int64)
        return self._check_ids({"text": text, "label": label}, idx)

    def _check_ids(self, sample: dict[str, np.ndarray], idx: int) -> dict[str, np.ndarray]:
        text = sample["text"]
        if (
            self.vocab_size is not None
            and text.size
            and (top := int(text.max())) >= self.vocab_size
        ):
            raise ValueError(
                f"{self.indexed.prefix}.bin: {self.name} sample {idx} holds token id {top}, but "
                f"the model has {self.vocab_size} token embeddings; the data was tokenized with "
                "another tokenizer: re-run tools/preprocess_data.py with this one"
            )
        return sample

    def _padded(self, sample: int) -> dict[str, np.ndarray]:
        text = self.whole_documents(sample, self.indexed).astype(np.int64)
        label = text if self.label is None else self.whole_documents(sample, self.label)
        pad = self.seq_length + 1 - len(text)
        return {
            # 0 pads the inputs as gpt-neox does; the padding comes after every real token, so
            # causal attention keeps it out of their predictions, and its labels are -100.
            "text": np.pad(text, (0, pad)),
            "label": np.pad(label.astype(np.int64), (0, pad), constant_values=IGNORE_INDEX),
        }
