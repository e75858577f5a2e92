"""HFTokenizer on the GPT-NeoX-20B JSON, and HFGPT2Tokenizer on local GPT-2 files."""

import json

import pytest
from tokenizers import Tokenizer as Backend

from neox.tokenizer import HFGPT2Tokenizer, HFTokenizer, build_tokenizer

TEXTS = ["Hello <|endoftext|> wörld\n\n    indented", "日本語 😀", "", "  x  "]


def test_20b_tokenizer_matches_tokenizers_and_round_trips(shared_data):
    path = str(shared_data / "20B_tokenizer.json")
    tok = build_tokenizer("HFTokenizer", path)
    assert isinstance(tok, HFTokenizer)
    reference = Backend.from_file(path)
    assert tok.vocab_size == reference.get_vocab_size() == 50277
    assert tok.eod == reference.token_to_id("<|endoftext|>") == 0
    assert tok.pad == reference.token_to_id("<|padding|>")  # None: 20B has no pad token
    speeches = (shared_data / "tinyshakespeare.txt").read_text().split("\n\n")[:500] + TEXTS
    assert tok.encode_batch(speeches) == [reference.encode(t).ids for t in speeches]
    assert [tok.decode(tok.encode(t)) for t in speeches] == speeches
    assert tok.encode("a<|endoftext|>b").count(tok.eod) == 1


def test_json_without_endoftext_is_refused(shared_data, tmp_path):
    spec = json.loads((shared_data / "20B_tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|endoftext|>"]
    del spec["model"]["vocab"]["<|endoftext|>"]
    path = tmp_path / "no_eod.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"no_eod.json.*'<\|endoftext\|>'"):
        HFTokenizer(str(path))


def test_hf_gpt2_from_local_files_adds_padding(shared_data):
    pytest.importorskip("transformers")
    vocab, merges = str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt")
    tok = build_tokenizer("HFGPT2Tokenizer", vocab, merges)
    assert isinstance(tok, HFGPT2Tokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad) == (50258, 50256, 50257)
    bpe = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    assert tok.encode_batch(TEXTS) == bpe.encode_batch(TEXTS)
    assert tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]


def test_hf_gpt2_vocab_file_without_merge_file_names_the_key(shared_data):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="merge_file"):
        HFGPT2Tokenizer(str(shared_data / "gpt2-vocab.json"))


def test_malformed_json_error_does_not_echo_its_strings(tmp_path):
    """A credentials JSON passed as vocab_file: the parser's error keeps the line and column,
    never the secret it read."""
    bad = tmp_path / "credentials.json"
    bad.write_text('{"model": {"type": "BPE", "vocab": "wJalrXUtnFEMI/K7MDENG"}}')
    with pytest.raises(ValueError, match="not a tokenizers JSON file") as err:
        HFTokenizer(str(bad))
    assert "line 1 column" in str(err.value), err.value
    assert "wJalrXUtnFEMI" not in str(err.value), err.value


def test_hf_gpt2_bad_vocab_file_is_named_without_its_strings(shared_data, tmp_path):
    """A credentials JSON passed as vocab_file: one ValueError naming the files, no secret."""
    pytest.importorskip("transformers")
    bad = tmp_path / "credentials.json"
    bad.write_text('{"aws_secret_access_key": "wJalrXUtnFEMI/K7MDENG"}')
    merges = str(shared_data / "gpt2-merges.txt")
    with pytest.raises(ValueError, match="credentials.json") as err:
        build_tokenizer("HFGPT2Tokenizer", str(bad), merges)
    assert "wJalrXUtnFEMI" not in str(err.value), err.value
