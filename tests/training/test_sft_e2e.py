"""Supervised finetuning end to end on CPU ranks: data from tools' preprocessing with labels,
whole-document packing, a run stopped and resumed logs the losses of an uninterrupted one."""

import json
import shutil

import pytest

from neox.prep.masking import MaskEncoder
from neox.prep.preprocess import PreprocessConfig, preprocess
from neox.tokenizer import build_tokenizer
from tests.train_helpers import losses, records, train, write_config

pytestmark = pytest.mark.slow


def qa_datasets(tmp_path):
    """Question/answer documents, labels trained on the answers only (char-level tokens)."""
    src = tmp_path / "qa.jsonl"
    docs = [f"Q: what is {i} plus {i % 7}? A: {i + i % 7}, I think." for i in range(120)]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    config = PreprocessConfig(
        inputs=str(src),
        output_prefix=str(tmp_path / "qa"),
        tokenizer_type="CharLevelTokenizer",
        append_eod=True,
        workers=0,
        progress=False,
    )
    tok = build_tokenizer("CharLevelTokenizer")
    preprocess(config, MaskEncoder(config, list(b"A: "), "uint16", tok))
    return str(tmp_path / "qa_text_document"), str(tmp_path / "qa_label_document")


def test_sft_run_resumes_exactly(tmp_path):
    text, label = qa_datasets(tmp_path)
    keys = dict(
        data_path=None,
        train_data_paths=[text],
        train_label_data_paths=[label],
        valid_data_paths=[text],
        valid_label_data_paths=[label],
        do_test=False,
        pack_impl="pack_until_overflow",
        reset_attention_mask=True,
        reset_position_ids=True,
    )
    train(write_config(tmp_path, "full", **keys))
    full = losses(tmp_path / "full" / "logs")
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and full[6] < full[1]
    logged = [r for r in records(tmp_path / "full" / "logs") if r["split"] == "train"]
    # Only answers train: far fewer tokens than the step's samples hold.
    assert all(0 < r["trained_tokens"] < r["consumed_tokens"] / r["step"] / 3 for r in logged)
    assert logged[-1]["consumed_trained_tokens"] == sum(r["trained_tokens"] for r in logged)

    train(write_config(tmp_path, "part", exit_interval=3, **keys))
    shutil.copytree(tmp_path / "part" / "ckpt", tmp_path / "step3")
    r = train(write_config(tmp_path, "part", **keys))
    assert "resuming from" in r.stdout
    part = losses(tmp_path / "part" / "logs")
    assert sorted(part) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert part[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step
    resumed = [r for r in records(tmp_path / "part" / "logs") if r["split"] == "train"]
    assert resumed[-1]["consumed_trained_tokens"] == logged[-1]["consumed_trained_tokens"]
