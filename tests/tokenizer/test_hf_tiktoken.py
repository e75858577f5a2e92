"""HFTokenizer's tiktoken path: the same ids as the tokenizers library on any text."""

import json
import logging
import random
import unicodedata

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from neox.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def path_20b(shared_data):
    return str(shared_data / "20B_tokenizer.json")


@pytest.fixture(scope="module")
def fast(path_20b):
    tok = HFTokenizer(path_20b)
    assert tok.backend == "tiktoken"
    return tok


@pytest.fixture(scope="module")
def reference(path_20b):
    return Backend.from_file(path_20b)


def reference_ids(reference, texts):
    return [e.ids for e in reference.encode_batch(texts)]


def adversarial_texts() -> list[str]:
    texts = ["", " ", "\t", "\n", "<|endoftext|>", "<|unk|>", "<|padding|>", "<|endoftext"]
    for n in range(1, 31):  # 20B's added tokens are runs of 2..24 spaces
        run = " " * n
        texts += [run, f"a{run}", f"{run}a", f"a{run}b", f"\n{run}x", f"x{run}\n", f"{run}\t{run}"]
        texts += [f"<|endoftext|>{run}<|endoftext|>", f"1{run}2", f"'s{run}'ll", f"{run}😀"]
    texts += [
        "\t\t \n \n\n  \t x \r\n\r\n   y\u00a0\u00a0 z\u3000\u3000w\u2028\u2029",
        "e\u0301 cafe\u0301 Å A\u030a \u212b \ufb01 \uac00 \u1100\u1161\u11a8 \u0958",  # NFC changes
        "<|endoftext|>\u0338 a<\u0338 >\u0338 \u0338<|unk|>",  # NFC would eat the special's ">"
        "😀😃👍🏽 👨‍👩‍👧‍👦 🇯🇵 \U0001f9d1\u200d\U0001f4bb",
        "Hello <|endoftext|> wörld\n\n    indented<|endoftext|><|endoftext|>",
        "日本語のテキスト 中文 한국어 العربية עברית हिन्दी ไทย",
        "I'm you're it's we've they'll he'd 'S 'LL ''s",
        "123 4567 ½ ² ٣ 𝟘 Ⅻ",
        "a" * 5000,
        "supercalifragilistic" * 300,
        " " * 1000 + "x",
        "\n" * 300 + "x" + "\t" * 300,
        "é" * 2000 + " " + "😀" * 500,
        "x" + "\u0301" * 400,
    ]
    return texts


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Texts glued from pieces that interact at the boundaries the encoder handles."""
    pieces = [" ", "  ", "   ", "\t", "\n", "\r\n", "a", "ab", "The", "1", "23", "'s", "'", "!",
              "?!", ".", "é", "e\u0301", "\u0301", "<\u0338", "日本", "😀", "\u00a0", "\u3000",
              "<|endoftext|>", "<|unk|>", "<|", "|>", "Ġ", "\u200d", "ß", "İ"]  # fmt: skip
    rng = random.Random(seed)
    return ["".join(rng.choices(pieces, k=rng.randint(0, 60))) for _ in range(n)]


def test_ids_match_tokenizers_on_whole_lambada_and_shakespeare(shared_data, fast, reference):
    with open(shared_data / "lambada_test.jsonl", encoding="utf-8") as f:
        passages = [json.loads(line)["text"] for line in f]
    shakespeare = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")
    texts = passages + [shakespeare] + shakespeare.split("\n\n")
    assert len(passages) == 5153
    assert fast.encode_batch(texts) == reference_ids(reference, texts)


def test_ids_match_tokenizers_on_adversarial_and_random_text(fast, reference):
    texts = adversarial_texts() + random_texts(3000)
    got = fast.encode_batch(texts)
    want = reference_ids(reference, texts)
    assert [t for t, g, w in zip(texts, got, want) if g != w] == []
    assert [fast.encode(t) for t in texts[:200]] == want[:200]
    assert 50276 in fast.encode("a  b") and fast.encode("") == []


def test_every_code_point_encodes_as_in_tokenizers(fast, reference):
    """The libraries' Unicode tables (letters, numbers, spaces, NFC) agree on every character.

    Planes 0-3 and 14 hold every assigned character; the unassigned planes are sampled.
    """
    code_points = [*range(0x80, 0xD800), *range(0xE000, 0x32400), *range(0xE0000, 0xE0200)]
    code_points += range(0x32400, 0x110000, 97)
    chars = [chr(c) for c in code_points]
    texts = []
    for i in range(0, len(chars), 500):
        block = chars[i : i + 500]
        texts.append("".join(f"a{c}1{c}!{c} {c}\u0316" for c in block))
    assert fast.encode_batch(texts) == reference_ids(reference, texts)


def test_decode_is_the_tokenizers_decode(fast, reference):
    for text in adversarial_texts():
        ids = fast.encode(text)
        assert fast.decode(ids) == reference.decode(ids, skip_special_tokens=False)
        if unicodedata.is_normalized("NFC", text):
            assert fast.decode(ids) == text


def test_lone_surrogate_raises_as_tokenizers_does(fast, reference):
    with pytest.raises(TypeError) as want:
        reference.encode("a\ud800b")
    with pytest.raises(TypeError, match=str(want.value)):
        fast.encode("a\ud800b")


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda s: s.update(normalizer={"type": "Lowercase"}), "normalizer"),
        (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "pre_tokenizer"),
        (lambda s: s["model"].update(ignore_merges=True), "ignore_merges"),
        (lambda s: s["added_tokens"][-1].update(lstrip=True), "lstrip"),
        (lambda s: s["model"]["merges"].reverse(), "merge order"),
    ],
)
def test_other_json_shapes_fall_back_to_tokenizers(path_20b, tmp_path, caplog, change, reason):
    spec = json.loads(open(path_20b, encoding="utf-8").read())
    change(spec)
    path = tmp_path / "other.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    with caplog.at_level(logging.DEBUG, logger="neox.tokenizer.hf"):
        tok = HFTokenizer(str(path))
    assert tok.backend == "tokenizers"
    assert reason in caplog.text
    texts = ["Hello  World <|endoftext|> x", "  indented\n\ttext"]
    assert tok.encode_batch(texts) == reference_ids(Backend.from_file(str(path)), texts)
    with pytest.raises(ValueError, match=f"backend='tiktoken'.*{reason}.*backend='tokenizers'"):
        HFTokenizer(str(path), backend="tiktoken")


def test_tokens_bpe_never_builds_are_not_ranked(tmp_path):
    """Merges b+c, a+b, ab+c: BPE leaves "abc" as [a, bc], never joining a+bc into "abc"."""
    from neox.tokenizer.gpt2 import byte_to_char

    vocab = {c: i for i, c in enumerate(byte_to_char().values())}
    vocab["<|endoftext|>"] = len(vocab)
    for token in ("bc", "ab", "abc"):
        vocab[token] = len(vocab)
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.add_special_tokens(["<|endoftext|>"])
    path = tmp_path / "stray.json"
    backend.save(str(path))
    tok, reference = HFTokenizer(str(path)), Backend.from_file(str(path))
    assert tok.backend == "tiktoken"
    texts = ["abc", "abcabc ab abc", "xabcz", "bcab"]
    assert reference.encode("abc").ids == [vocab["a"], vocab["bc"]]
    assert tok.encode_batch(texts) == reference_ids(reference, texts)

    import tiktoken  # every token ranked by id: tiktoken would join a+bc, unlike tokenizers

    naive = {t.encode("latin-1"): i for t, i in vocab.items() if len(t) > 1 and t.isascii()}
    naive |= {bytes([b]): vocab[c] for b, c in byte_to_char().items()}
    enc = tiktoken.Encoding("naive", pat_str=r"\S+|\s+", mergeable_ranks=naive, special_tokens={})
    assert enc.encode_ordinary("abc") == [vocab["abc"]]


def test_a_tokenizer_trained_here_takes_the_fast_path_with_the_same_ids(shared_data, tmp_path):
    from neox.prep.tokenizer_training import train_bpe_tokenizer

    text = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")
    path = train_bpe_tokenizer([str(shared_data / "tinyshakespeare.txt")], tmp_path / "t.json", 800)
    tok, reference = HFTokenizer(str(path)), Backend.from_file(str(path))
    assert tok.backend == "tiktoken"
    texts = text.split("\n\n")[:2000] + adversarial_texts()
    assert tok.encode_batch(texts) == reference_ids(reference, texts)
