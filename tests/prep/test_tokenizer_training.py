"""train_bpe_tokenizer: a byte-level BPE that HFTokenizer loads and that round-trips text."""

import json

import pytest

from neox.prep.tokenizer_training import train_bpe_tokenizer
from neox.tokenizer import HFTokenizer


def test_trained_tokenizer_loads_and_round_trips(shared_data, tmp_path):
    path = train_bpe_tokenizer(
        [str(shared_data / "tinyshakespeare.txt")], tmp_path / "tok.json", vocab_size=600
    )
    tok = HFTokenizer(str(path))
    assert tok.vocab_size == 600
    assert (tok.eod, tok.pad) == (0, 1)  # special tokens first, in the order given
    text = "ROMEO:\nBut soft, what light through yonder window breaks? 日本 😀  \t<|endoftext|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[-1] == tok.eod
    # BPE learned merges from the text: common words take fewer ids than bytes.
    assert len(tok.encode(" the king")) < len(b" the king")


def test_jsonl_key_and_globs(shared_data, tmp_path):
    lines = (shared_data / "lambada_test.jsonl").read_text().splitlines()[:300]
    docs = [{"passage": json.loads(line)["text"]} for line in lines]
    (tmp_path / "part1.jsonl").write_text("\n".join(json.dumps(d) for d in docs[:150]))
    (tmp_path / "part2.jsonl").write_text("\n".join(json.dumps(d) for d in docs[150:]))
    path = train_bpe_tokenizer(
        [str(tmp_path / "part*.jsonl")],
        tmp_path / "out" / "tok.json",
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        jsonl_key="passage",
    )
    tok = HFTokenizer(str(path))
    assert tok.vocab_size == 400 and tok.pad is None
    assert tok.decode(tok.encode(docs[0]["passage"])) == docs[0]["passage"]


def test_too_small_vocab_says_the_minimum(shared_data, tmp_path):
    with pytest.raises(ValueError, match="258"):
        train_bpe_tokenizer([str(shared_data / "tinyshakespeare.txt")], tmp_path / "t.json", 100)
    assert not (tmp_path / "t.json").exists()
