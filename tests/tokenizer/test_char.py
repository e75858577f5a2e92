"""CharLevelTokenizer: gpt-neox's ids (UTF-8 bytes, vocab 512, eod 0) and an exact inverse."""

from neox.tokenizer import CharLevelTokenizer, build_tokenizer


def test_ids_are_utf8_bytes_with_gpt_neox_sizes():
    tok = build_tokenizer("CharLevelTokenizer")
    assert isinstance(tok, CharLevelTokenizer)
    assert (tok.vocab_size, tok.eod) == (512, 0)
    assert tok.encode("Hi\n") == [72, 105, 10]
    assert tok.encode("é") == [0xC3, 0xA9]


def test_decode_inverts_encode_on_real_text(shared_data):
    tok = CharLevelTokenizer()
    text = (shared_data / "tinyshakespeare.txt").read_text()[:20000] + " héllo 日本 😀\t\n"
    batch = tok.encode_batch([text, ""])
    assert batch == [tok.encode(text), []]
    assert tok.decode(batch[0]) == text


def test_ids_outside_bytes_decode_to_replacement_character():
    tok = CharLevelTokenizer()
    assert tok.decode([104, 300, 105]) == "h\ufffdi"
