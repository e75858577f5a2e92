"""Prompt/answer masking without a template (neox/prep/masking.py,
tools/preprocess_data_with_mask.py), on the char-level tokenizer (ids are UTF-8 bytes)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from neox.data.indexed import IndexedDataset
from neox.prep.masking import first_match_end, mask_before, parse_token_pattern

ROOT = Path(__file__).resolve().parents[2]


def test_labels_mask_up_to_and_including_the_first_delimiter():
    tokens = np.array([5, 1, 2, 7, 1, 2, 9])
    labels, matched = mask_before(tokens, [1, 2])
    assert matched and labels.tolist() == [-100, -100, -100, 7, 1, 2, 9]
    assert labels.dtype == np.int32
    unmatched, matched = mask_before(tokens, [2, 1])
    assert not matched and unmatched.tolist() == tokens.tolist()  # gpt-neox: all trained
    assert first_match_end(np.array([1]), [1, 2]) == -1


def test_token_pattern_parsing_names_the_expected_form():
    assert parse_token_pattern("0,1,1270") == [0, 1, 1270]
    with pytest.raises(ValueError, match="comma-separated token ids"):
        parse_token_pattern("Answer:")


def test_cli_writes_gpt_neox_names_and_counts_documents_without_a_delimiter(tmp_path):
    docs = ["Q: 2+2? A: 4", "Q: capital of France? A: Paris", "no delimiter here"]
    src = tmp_path / "qa.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    pattern = ",".join(str(b) for b in b"A: ")
    out = tmp_path / "qa"
    r = subprocess.run(
        [sys.executable, "tools/preprocess_data_with_mask.py", "--input", str(src)]
        + ["--output-prefix", str(out), "--tokenizer-type", "CharLevelTokenizer"]
        + ["--append-eod", "--mask-before-token", pattern, "--workers", "0", "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "note: 1 documents had no --mask-before-token match" in r.stderr
    text = IndexedDataset(f"{out}_text_document")
    label = IndexedDataset(f"{out}_label_document")  # gpt-neox's name for the one key
    assert np.array_equal(text.sizes, label.sizes) and label.dtype == np.int32
    for i, doc in enumerate(docs):
        tokens, labels = text[i], label[i]
        trained = bytes(tokens[labels != -100].tolist())
        if "A: " in doc:
            assert trained == doc.split("A: ", 1)[1].encode() + b"\0"  # answer and EOD
            assert bytes(tokens[labels == -100].tolist()) == doc.split("A: ")[0].encode() + b"A: "
        else:
            assert trained == doc.encode() + b"\0"
