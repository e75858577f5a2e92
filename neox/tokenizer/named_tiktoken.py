"""OpenAI's named tiktoken encodings (cl100k_base, o200k_base, ...), fetched on first use."""

from __future__ import annotations

from neox.tokenizer.base import Tokenizer


class TiktokenTokenizer(Tokenizer):
    """A named tiktoken encoding; `vocab_file` holds the name, as in gpt-neox."""

    name = "TiktokenTokenizer"

    def __init__(self, vocab_file: str | None) -> None:
        import tiktoken

        names = sorted(tiktoken.list_encoding_names())
        if vocab_file not in names:
            raise ValueError(
                f"TiktokenTokenizer: vocab_file={vocab_file!r} is not a tiktoken encoding name; "
                f"set `vocab_file` to one of {names}"
            )
        try:
            self._enc = tiktoken.get_encoding(vocab_file)
        except Exception as err:  # requests errors, or a bad cached file
            raise ConnectionError(
                f"TiktokenTokenizer: could not fetch tiktoken encoding {vocab_file!r} ({err}); "
                "tiktoken downloads it on first use. Run once with network access (it is cached "
                "under TIKTOKEN_CACHE_DIR), or use GPT2BPETokenizer/HFTokenizer with local files"
            ) from err
        self._special = set(self._enc.special_tokens_set)

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def eod(self) -> int:
        return self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special=self._special)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encode = self._enc.encode  # a loop beats tiktoken's thread pool (see gpt2.py)
        return [encode(text, allowed_special=self._special) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids, errors="replace")
