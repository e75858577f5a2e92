"""Prompt/answer masking without a chat template (gpt-neox's preprocess_data_with_mask.py).

Each document is tokenized as tools/preprocess_data.py does; its label dataset holds -100 for
every token up to and including the first occurrence of the `--mask-before-token` id sequence
(e.g. the tokens of "Answer:"), and the token id after it. A document without the sequence is
trained on every token, as in gpt-neox, and counted in the report. Files: the tokens in
<prefix>_<key>_document, the labels in <prefix>_label_document (one key, gpt-neox's name) or
<prefix>_<key>_label_document (several), int32.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from neox.data.indexed import IGNORE_INDEX
from neox.prep.preprocess import EncodedBatch, PreprocessConfig, TextEncoder, output_prefix_for
from neox.prep.readers import RawBatch

LABEL_DTYPE = np.dtype(np.int32)
NO_MATCH = "had no --mask-before-token match and are trained on every token"


def parse_token_pattern(spec: str) -> list[int]:
    """Token ids from "0,1,1270" (the encoded delimiter)."""
    try:
        ids = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--mask-before-token {spec!r} must be comma-separated token ids, e.g. 0,1,1270 "
            "(the ids of your delimiter as the tokenizer encodes it)"
        ) from None
    if not ids or min(ids) < 0:
        raise ValueError(f"--mask-before-token {spec!r} must name at least one id >= 0")
    return ids


def first_match_end(tokens: np.ndarray, pattern: Sequence[int]) -> int:
    """Index just past the first occurrence of `pattern` in `tokens`, or -1."""
    m = len(pattern)
    if len(tokens) < m:
        return -1
    windows = np.lib.stride_tricks.sliding_window_view(tokens, m)
    hits = np.flatnonzero((windows == np.asarray(pattern)).all(axis=1))
    return int(hits[0]) + m if hits.size else -1


def mask_before(tokens: np.ndarray, pattern: Sequence[int]) -> tuple[np.ndarray, bool]:
    """(labels, matched): -100 up to and including the first `pattern`, the tokens after."""
    labels = tokens.astype(LABEL_DTYPE)
    end = first_match_end(tokens, pattern)
    if end >= 0:
        labels[:end] = IGNORE_INDEX
    return labels, end >= 0


def label_name(keys: Sequence[str], key: str) -> str:
    """The label dataset's name for `key`: gpt-neox's "label" when there is one key."""
    return "label" if len(keys) == 1 else f"{key}_label"


class MaskEncoder(TextEncoder):
    """Text datasets as preprocess_data.py writes them, plus their masked label datasets."""

    def __init__(self, config: PreprocessConfig, pattern: Sequence[int], dtype, tokenizer=None):
        super().__init__(config, dtype, tokenizer)
        self.pattern = list(pattern)
        keys = config.jsonl_keys
        clash = {label_name(keys, k) for k in keys} & set(keys)
        if clash:
            raise ValueError(
                f"--jsonl-keys {' '.join(keys)} include {', '.join(sorted(clash))}, the name of "
                "the label dataset this tool writes; rename that key"
            )

    @property
    def outputs(self) -> dict[str, tuple[str, np.dtype]]:
        out = dict(super().outputs)
        keys = self.config.jsonl_keys
        for key in keys:
            name = label_name(keys, key)
            out[name] = (output_prefix_for(self.config.output_prefix, name), LABEL_DTYPE)
        return out

    def describe(self) -> str:
        return f"{super().describe()}, masking up to {self.pattern} (labels {LABEL_DTYPE})"

    def encode(self, batch: RawBatch) -> EncodedBatch:
        enc = super().encode(batch)
        notes: Counter = Counter()
        keys = self.config.jsonl_keys
        for key in keys:
            tokens, sizes = enc.tokens[key]
            labels = np.empty(tokens.size, dtype=LABEL_DTYPE)
            start = 0
            for n in sizes.tolist():
                doc = tokens[start : start + n]
                labels[start : start + n], matched = mask_before(doc, self.pattern)
                notes[NO_MATCH] += not matched
                start += n
            enc.tokens[label_name(keys, key)] = (labels, sizes.copy())
        enc.notes = +notes
        return enc
