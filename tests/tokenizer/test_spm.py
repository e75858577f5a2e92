"""SPMTokenizer on a SentencePiece model the test trains on Tiny Shakespeare."""

import builtins

import pytest

from neox.tokenizer import SPMTokenizer, build_tokenizer


@pytest.fixture
def spm_model(shared_data, tmp_path):
    spm = pytest.importorskip("sentencepiece")
    lines = (shared_data / "tinyshakespeare.txt").read_text().splitlines()[:4000]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(line for line in lines if line.strip()))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "tiny"),
        vocab_size=300,
        model_type="bpe",
        eos_id=2,
        minloglevel=2,
    )
    return str(tmp_path / "tiny.model"), spm


def test_tiny_model_round_trips_and_uses_eos_as_eod(spm_model):
    path, spm = spm_model
    tok = build_tokenizer("SPMTokenizer", path)
    assert isinstance(tok, SPMTokenizer)
    reference = spm.SentencePieceProcessor(model_file=path)
    assert tok.vocab_size == 300
    assert tok.eod == reference.eos_id() == 2
    texts = ["First Citizen:\nBefore we proceed any further, hear me speak.", "All: Speak."]
    assert tok.encode_batch(texts) == [reference.encode(t) for t in texts]
    assert tok.encode(texts[1]) == reference.encode(texts[1])
    assert tok.decode(tok.encode("Speak, speak.")) == "Speak, speak."


def test_missing_sentencepiece_says_how_to_install(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_sentencepiece(name, *args, **kwargs):
        if name == "sentencepiece":
            raise ImportError("No module named 'sentencepiece'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sentencepiece)
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        SPMTokenizer(str(tmp_path / "any.model"))


def test_non_model_file_is_named(tmp_path):
    pytest.importorskip("sentencepiece")
    bad = tmp_path / "not_a.model"
    bad.write_text("hello")
    with pytest.raises(ValueError, match="not_a.model"):
        SPMTokenizer(str(bad))
