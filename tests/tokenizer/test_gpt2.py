"""GPT2BPETokenizer: ids equal Hugging Face's GPT-2 tokenizer; tiktoken and tokenizers agree."""

import json
import shutil

import pytest

from neox.tokenizer.gpt2 import GPT2BPETokenizer, byte_to_char, tiktoken_ranks

EDGE_CASES = [
    "",
    " ",
    "   leading and trailing   ",
    "tabs\tand\nnewlines\n\n\n   indented\r\n",
    "unicode: héllo wörld — 日本語 😀 ﬁ Ω",
    "numbers 12345 3.14 and 'quotes' it's we'll they're",
    "<|endoftext|>",
    "doc one<|endoftext|>doc two",
    " <|endoftext|> <|endoftext|><|endoftext|>\n",
    "almost special <|endoftext| and <|padding|>",
]


def real_texts(shared_data) -> list[str]:
    """Tiny Shakespeare speeches and LAMBADA passages, plus the edge cases above."""
    speeches = (shared_data / "tinyshakespeare.txt").read_text().split("\n\n")[:1500]
    with open(shared_data / "lambada_test.jsonl") as f:
        lambada = [json.loads(line)["text"] for _, line in zip(range(1500), f)]
    return speeches + lambada + EDGE_CASES


@pytest.fixture
def gpt2_files(shared_data):
    return str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt")


@pytest.fixture
def hf_reference(gpt2_files, tmp_path):
    """transformers' GPT2TokenizerFast loaded from a directory holding the same two files."""
    transformers = pytest.importorskip("transformers")
    shutil.copy(gpt2_files[0], tmp_path / "vocab.json")
    shutil.copy(gpt2_files[1], tmp_path / "merges.txt")
    return transformers.GPT2TokenizerFast.from_pretrained(str(tmp_path))


def test_byte_map_is_a_bijection_onto_vocab_characters(gpt2_files):
    table = byte_to_char()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    vocab = json.load(open(gpt2_files[0]))
    assert all(ch in vocab for ch in table.values())


def test_ids_match_huggingface_on_real_text(shared_data, gpt2_files, hf_reference):
    texts = real_texts(shared_data)
    expected = [hf_reference.encode(t) for t in texts]
    for backend in ("tiktoken", "tokenizers"):
        tok = GPT2BPETokenizer(*gpt2_files, backend=backend)
        assert tok.backend == backend
        assert tok.encode_batch(texts) == expected, backend
        assert [tok.encode(t) for t in EDGE_CASES] == expected[-len(EDGE_CASES) :]


def test_eod_text_inside_a_document_becomes_the_eod_id(gpt2_files):
    tok = GPT2BPETokenizer(*gpt2_files)
    assert (tok.vocab_size, tok.eod) == (50257, 50256)
    ids = tok.encode("a<|endoftext|>b")
    assert ids == [tok.encode("a")[0], tok.eod, tok.encode("b")[0]]
    assert tok.eod not in tok.encode("<|endoftext|")


def test_decode_inverts_encode(shared_data, gpt2_files):
    for backend in ("tiktoken", "tokenizers"):
        tok = GPT2BPETokenizer(*gpt2_files, backend=backend)
        for text in real_texts(shared_data)[::50] + EDGE_CASES:
            assert tok.decode(tok.encode(text)) == text
        # A lone continuation byte is not valid UTF-8: both backends replace it.
        assert tok.decode(tok.encode("日")[:1]) == "\ufffd"


def test_auto_backend_falls_back_when_ranks_do_not_follow_merges(gpt2_files, tmp_path):
    vocab = json.load(open(gpt2_files[0]))
    merges = open(gpt2_files[1]).read().splitlines()
    # Swap the first two merges: ids no longer rise with merge order, which tiktoken needs.
    merges[1], merges[2] = merges[2], merges[1]
    (tmp_path / "merges.txt").write_text("\n".join(merges) + "\n")
    tok = GPT2BPETokenizer(gpt2_files[0], str(tmp_path / "merges.txt"))
    assert tok.backend == "tokenizers"
    assert tiktoken_ranks(vocab, [tuple(m.split()) for m in merges[1:]]) is None
    with pytest.raises(ValueError, match="tiktoken"):
        GPT2BPETokenizer(gpt2_files[0], str(tmp_path / "merges.txt"), backend="tiktoken")


# Speed is measured by benchmarks/preprocess.py (docs/benchmarks.md), never by a timed test.


def test_bad_merges_line_is_named(gpt2_files, tmp_path):
    bad = tmp_path / "merges.txt"
    bad.write_text("#version: 0.2\nĠ t\nthree parts here\n")
    with pytest.raises(ValueError, match=r"line 3.*merge_file"):
        GPT2BPETokenizer(gpt2_files[0], str(bad))


def test_bad_merges_line_is_not_echoed(gpt2_files, tmp_path):
    """A credentials file passed as merge_file by mistake: the error names the file and line,
    never the secret on it."""
    secret = "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    bad = tmp_path / "credentials"
    bad.write_text(f"{secret}\n")
    with pytest.raises(ValueError) as err:
        GPT2BPETokenizer(gpt2_files[0], str(bad))
    message = str(err.value)
    assert f"{bad}" in message and "line 1" in message, message
    for word in ("aws_secret_access_key", "wJalrXUtnFEMI"):
        assert word not in message, message


def test_binary_merges_file_is_named(gpt2_files, tmp_path):
    bad = tmp_path / "key.der"
    bad.write_bytes(b"\xff\xfe secret bytes\n")
    with pytest.raises(ValueError, match=r"merge_file=.*key\.der.* is not UTF-8 text"):
        GPT2BPETokenizer(gpt2_files[0], str(bad))
