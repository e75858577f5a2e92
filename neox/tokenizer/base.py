"""The one interface every tokenizer implements."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Tokenizer(ABC):
    """Text <-> token ids, plus the end-of-document id that separates documents."""

    name: str = "tokenizer"

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before any padding for the model)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """Id appended after each document."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of one text."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts; subclasses override this with a batched backend."""
        return [self.encode(text) for text in texts]

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of a list of ids."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


def require_file(path: str | None, key: str, tokenizer_type: str) -> str:
    """Return `path` if it names a readable file, else raise an error naming the config key."""
    if path is None:
        raise ValueError(
            f"{tokenizer_type} needs a {key}; set `{key}` in the config "
            f"(or --{key.replace('_', '-')} on the command line)"
        )
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise FileNotFoundError(
            f"{tokenizer_type}: cannot read {key}={path!r} ({err.strerror}); "
            f"set `{key}` to an existing file"
        ) from err
    return str(path)
