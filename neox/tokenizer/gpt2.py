"""GPT-2 byte-level BPE from vocab.json + merges.txt, encoded by tiktoken when it can be."""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Literal

from neox.tokenizer.base import Tokenizer, require_file

logger = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"

# GPT-2's pre-tokenizer split (contractions, letters, numbers, other, whitespace); the same
# expression tokenizers' ByteLevel pre-tokenizer applies, so both backends see the same pieces.
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

Backend = Literal["auto", "tiktoken", "tokenizers"]


@lru_cache(maxsize=1)
def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character used in vocab.json."""
    # Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted past 255.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def read_gpt2_files(
    vocab_file: str, merge_file: str
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Load vocab.json and merges.txt, with errors that name the file and line."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"vocab_file={vocab_file!r} is not a GPT-2 vocab.json ({err}); "
            "set `vocab_file` to the JSON token -> id map"
        ) from err
    if not isinstance(vocab, dict):
        raise ValueError(f"vocab_file={vocab_file!r} must hold a JSON object of token -> id")
    try:
        merges = _read_merges(merge_file)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"merge_file={merge_file!r} is not UTF-8 text ({err.reason}); "
            "set `merge_file` to a GPT-2 merges.txt"
        ) from None
    return vocab, merges


def _read_merges(merge_file: str) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    with open(merge_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(
                    # Never echo the line: a file passed by mistake may hold secrets.
                    f"merge_file={merge_file!r} line {lineno}: expected two tokens separated "
                    f"by one space, found {len(parts)} space-separated fields in "
                    f"{len(line)} characters (content not shown); "
                    "set `merge_file` to a GPT-2 merges.txt"
                )
            merges.append((parts[0], parts[1]))
    return merges


def tiktoken_ranks(vocab: dict[str, int], merges: list[tuple[str, str]]) -> dict[bytes, int] | None:
    """Byte-sequence ranks for tiktoken, or None when tiktoken could not reproduce the BPE.

    tiktoken merges the adjacent pair whose joined bytes have the lowest rank, while the merges
    file ranks pairs. Using token ids as ranks gives the same tokens when the 256 bytes are in
    the vocab and each merge yields a new id larger than every earlier merge's, as in GPT-2.
    """
    char_to_byte = {c: b for b, c in byte_to_char().items()}
    ranks: dict[bytes, int] = {}
    for token, idx in vocab.items():
        if token == END_OF_TEXT:
            continue
        try:
            ranks[bytes(char_to_byte[c] for c in token)] = idx
        except KeyError:
            return None  # not a byte-level vocabulary
    if len(ranks) != len(vocab) - (END_OF_TEXT in vocab) or any(
        bytes([b]) not in ranks for b in range(256)
    ):
        return None
    last = max(ranks[bytes([b])] for b in range(256))
    for left, right in merges:
        idx = vocab.get(left + right)
        if idx is None or idx <= last:
            return None
        last = idx
    if len(ranks) != 256 + len(merges):
        return None  # tokens no merge produces would be reachable by tiktoken only
    return ranks


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE; ids equal Hugging Face's GPT2TokenizerFast on the same files.

    "<|endoftext|>" written inside a document becomes the single eod id, as the Hugging Face
    reference (and gpt-neox's GPT2Tokenizer) encode it; the other text is BPE'd byte by byte.
    Encoding uses tiktoken when it is importable and the files allow it (about 1.8x faster than
    tokenizers on real text, same ids); otherwise the tokenizers library.
    """

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str, backend: Backend = "auto") -> None:
        require_file(vocab_file, "vocab_file", self.name)
        require_file(merge_file, "merge_file", self.name)
        vocab, merges = read_gpt2_files(vocab_file, merge_file)
        if END_OF_TEXT not in vocab:
            raise ValueError(
                f"vocab_file={vocab_file!r} has no {END_OF_TEXT!r} token, which GPT2BPETokenizer "
                "uses as eod; use a GPT-2 vocab.json or an HFTokenizer JSON"
            )
        self._vocab_size = len(vocab)
        self._eod = vocab[END_OF_TEXT]
        self._special = {END_OF_TEXT}
        self._tiktoken = None
        self._tokenizers = None
        if backend in ("auto", "tiktoken"):
            self._tiktoken = _build_tiktoken(
                vocab, merges, self._eod, required=backend == "tiktoken"
            )
        if self._tiktoken is None:
            self._tokenizers = _build_tokenizers(vocab, merges)
        self.backend = "tiktoken" if self._tiktoken is not None else "tokenizers"

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        if self._tiktoken is not None:
            return self._tiktoken.encode(text, allowed_special=self._special)
        return self._tokenizers.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._tiktoken is not None:
            # A plain loop: tiktoken's encode_batch hands each text to a thread pool, whose
            # per-task overhead made it 2.5x slower than this loop on real documents. Use
            # worker processes, not threads, to spread preprocessing over cores.
            encode = self._tiktoken.encode
            return [encode(text, allowed_special=self._special) for text in texts]
        return [e.ids for e in self._tokenizers.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        if self._tiktoken is not None:
            return self._tiktoken.decode(ids, errors="replace")
        return self._tokenizers.decode(ids, skip_special_tokens=False)


def _build_tiktoken(vocab: dict[str, int], merges: list[tuple[str, str]], eod: int, required: bool):
    """A tiktoken Encoding for these files, or None (with the reason logged) when not possible."""
    try:
        import tiktoken
    except ImportError:
        if required:
            raise ImportError("backend='tiktoken' needs tiktoken: pip install tiktoken") from None
        logger.info("tiktoken not installed; GPT2BPETokenizer encodes with tokenizers")
        return None
    ranks = tiktoken_ranks(vocab, merges)
    if ranks is None:
        msg = "vocab/merges ranks are not tiktoken-compatible"
        if required:
            raise ValueError(f"backend='tiktoken': {msg}; use backend='tokenizers'")
        logger.info("%s; GPT2BPETokenizer encodes with tokenizers", msg)
        return None
    return tiktoken.Encoding(
        name="neox-gpt2-bpe",
        pat_str=GPT2_SPLIT_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={END_OF_TEXT: eod},
    )


def _build_tokenizers(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """The tokenizers-library equivalent of Hugging Face's GPT2TokenizerFast."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizerBackend

    tok = HFTokenizerBackend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    return tok
