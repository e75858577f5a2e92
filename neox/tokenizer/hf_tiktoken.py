"""Exact tiktoken encoding of a byte-level BPE tokenizers JSON (GPT-NeoX-20B's), for speed.

tokenizers encodes a text in four steps; this module repeats each so that the ids are the same:
1. Added tokens: those with normalized=False are cut out of the raw text, then each remaining
   piece is normalized and those with normalized=True are cut out of it. Both cuts take the
   leftmost match, the longest one there (an alternation sorted longest first does the same).
2. NFC, through tokenizers' own normalizer (Python's `unicodedata` follows another Unicode
   version). ASCII pieces skip it: NFC never changes them.
3. The ByteLevel pre-tokenizer's GPT-2 regex, here run by tiktoken on each remaining piece.
4. BPE, where the two libraries differ (see `reachable_ranks` for why the ids still agree).

`unsupported_reason` lists the JSON shapes this covers; anything else is left to tokenizers.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from neox.tokenizer.gpt2 import GPT2_SPLIT_PATTERN, byte_to_char


def unsupported_reason(spec: dict) -> str | None:
    """Why `spec` (a tokenizers JSON) cannot be reproduced exactly here, or None if it can."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"model type {model.get('type')!r} is not BPE"
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"BPE {key}={model[key]!r}"
    for key in ("fuse_unk", "byte_fallback", "ignore_merges"):
        if model.get(key):
            return f"BPE {key}=true"
    if spec.get("normalizer") not in (None, {"type": "NFC"}):
        return f"normalizer {spec['normalizer']!r} (only NFC or none)"
    pre = spec.get("pre_tokenizer") or {}
    if (
        pre.get("type") != "ByteLevel"
        or pre.get("add_prefix_space")
        or not pre.get("use_regex", True)
    ):
        return f"pre_tokenizer {pre!r} (only ByteLevel, add_prefix_space false, GPT-2 regex)"
    post = spec.get("post_processor")
    if post is not None and post.get("type") != "ByteLevel":
        return f"post_processor {post.get('type')!r} adds or changes ids"
    if spec.get("truncation") or spec.get("padding"):
        return "truncation or padding is set"
    for token in spec.get("added_tokens", []):
        if token.get("single_word") or token.get("lstrip") or token.get("rstrip"):
            return f"added token {token['content']!r} uses single_word/lstrip/rstrip"
        if not token.get("content"):
            return "an added token is empty"
    return None


def reachable_ranks(
    vocab: dict[str, int], merges: list[tuple[str, str]], bpe: Callable[[str], list[int]]
) -> dict[bytes, int] | None:
    """tiktoken ranks (token bytes -> id) giving the ids tokenizers' BPE gives, or None.

    tokenizers merges the adjacent pair that comes first in the merges list; tiktoken the pair
    whose joined bytes have the lowest rank, also when no merge joins that pair (a token "abc"
    made by "ab"+"c" would also join "a"+"bc"). Ranks are the token ids, so they must grow with
    the merge order, one merge per token. Then tiktoken can differ only by joining such a stray
    pair x+y, and if tokenizers ever holds x next to y, it stops at [x, y] when it encodes x+y
    alone (the merges inside a span do not depend on the text around it). So ranking only the
    tokens t that `bpe` (tokenizers' own BPE on one word) encodes as [t] rules stray joins out
    and drops nothing tokenizers could produce (20B drops just "<|endoftext|>" and "<|unk|>",
    which no merge builds; they are added tokens, cut out before BPE).
    """
    char_to_byte = {c: b for b, c in byte_to_char().items()}
    if not all(c in char_to_byte for token in vocab for c in token):
        return None  # not a byte-level vocabulary
    last = -1
    for left, right in merges:
        idx = vocab.get(left + right)
        if idx is None or idx <= last:
            return None
        last = idx
    ranks = {}
    for token, idx in vocab.items():
        if len(token) == 1 or bpe(token) == [idx]:
            ranks[bytes(char_to_byte[c] for c in token)] = idx
    return ranks


class TiktokenJsonEncoder:
    """`encode(text)` equal to `tokenizers.Tokenizer.from_file(path).encode(text).ids`.

    Build it with `build`, which returns None for JSON shapes it cannot reproduce.
    """

    def __init__(self, backend, spec: dict, ranks: dict[bytes, int]) -> None:
        import tiktoken

        self._backend = backend
        self._encoding = tiktoken.Encoding(
            name="neox-hf-json",
            pat_str=GPT2_SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={},
        )
        if spec.get("normalizer") is not None:
            from tokenizers import normalizers

            self._normalize = normalizers.NFC().normalize_str
        else:
            self._normalize = _require_utf8
        raw = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if not t["normalized"]}
        normalized = {
            self._normalize(t["content"]): t["id"]
            for t in spec.get("added_tokens", [])
            if t["normalized"]
        }
        self._raw, self._raw_ids = _longest_first(raw), raw
        self._normalized, self._normalized_ids = _longest_first(normalized), normalized

    @classmethod
    def build(cls, backend, spec: dict) -> tuple[TiktokenJsonEncoder | None, str | None]:
        """(encoder, None), or (None, the reason tokenizers must encode this JSON)."""
        reason = unsupported_reason(spec)
        if reason is None and getattr(backend, "encode_special_tokens", False):
            reason = "encode_special_tokens is on"
        if reason is not None:
            return None, reason
        model = spec["model"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        ranks = reachable_ranks(
            model["vocab"], merges, lambda w: [t.id for t in backend.model.tokenize(w)]
        )
        if ranks is None:
            return None, "vocab is not byte-level or its ids do not follow the merge order"
        return cls(backend, spec, ranks), None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        try:
            _split(text, self._raw, self._raw_ids, ids, self._encode_normalized)
        except UnicodeEncodeError:  # lone surrogates: tokenizers' own error, not tiktoken's fix
            return self._backend.encode(text).ids
        return ids

    def _encode_normalized(self, piece: str, ids: list[int]) -> None:
        if not piece.isascii():
            piece = self._normalize(piece)
        _split(piece, self._normalized, self._normalized_ids, ids, self._encode_ordinary)

    def _encode_ordinary(self, piece: str, ids: list[int]) -> None:
        ids += self._encoding.encode_ordinary(piece)


def _longest_first(tokens: dict[str, int]) -> re.Pattern | None:
    """A regex finding the leftmost token, the longest there (tokenizers' leftmost-longest)."""
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _split(text: str, pattern, token_ids, ids: list[int], encode_rest) -> None:
    """Append the ids of `text`: matches of `pattern` by `token_ids`, the rest by `encode_rest`."""
    start = 0
    if pattern is not None:
        for match in pattern.finditer(text):
            if match.start() > start:
                encode_rest(text[start : match.start()], ids)
            ids.append(token_ids[match.group()])
            start = match.end()
    if start < len(text):
        encode_rest(text[start:] if start else text, ids)


def _require_utf8(piece: str) -> str:
    """Raise UnicodeEncodeError on lone surrogates, which tokenizers refuses."""
    piece.encode("utf-8")
    return piece
