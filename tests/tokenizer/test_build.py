"""build_tokenizer: gpt-neox type names, and errors that name the key to fix."""

import pytest

from neox.tokenizer import TOKENIZER_TYPES, GPT2BPETokenizer, build_tokenizer


def test_type_names_are_case_insensitive(shared_data):
    tok = build_tokenizer(
        "gpt2bpetokenizer",
        str(shared_data / "gpt2-vocab.json"),
        str(shared_data / "gpt2-merges.txt"),
    )
    assert isinstance(tok, GPT2BPETokenizer)


def test_unknown_type_lists_the_valid_names():
    with pytest.raises(ValueError, match="GPT2BPETokenizer") as info:
        build_tokenizer("BertTokenizer")
    assert "'BertTokenizer'" in str(info.value)
    assert all(name in str(info.value) for name in TOKENIZER_TYPES)


@pytest.mark.parametrize(
    "kind, vocab, merge, key",
    [
        ("GPT2BPETokenizer", None, "gpt2-merges.txt", "vocab_file"),
        ("GPT2BPETokenizer", "gpt2-vocab.json", None, "merge_file"),
        ("GPT2BPETokenizer", "missing-vocab.json", "gpt2-merges.txt", "vocab_file"),
        ("GPT2BPETokenizer", "gpt2-vocab.json", "missing-merges.txt", "merge_file"),
        ("HFTokenizer", None, None, "vocab_file"),
        ("HFTokenizer", "missing.json", None, "vocab_file"),
        ("SPMTokenizer", "missing.model", None, "vocab_file"),
    ],
)
def test_missing_files_name_the_config_key(shared_data, kind, vocab, merge, key):
    def resolve(name):
        return None if name is None else str(shared_data / name)

    with pytest.raises((ValueError, FileNotFoundError)) as info:
        build_tokenizer(kind, resolve(vocab), resolve(merge))
    message = str(info.value)
    assert f"`{key}`" in message and kind in message
    missing = vocab if key == "vocab_file" else merge
    if missing is not None:
        assert missing in message


def test_directory_as_vocab_file_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="vocab_file"):
        build_tokenizer("HFTokenizer", str(tmp_path))
