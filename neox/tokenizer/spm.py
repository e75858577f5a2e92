"""SentencePiece models (the optional `sentencepiece` package)."""

from __future__ import annotations

from neox.tokenizer.base import Tokenizer, require_file

END_OF_TEXT = "<|endoftext|>"


class SPMTokenizer(Tokenizer):
    """A SentencePiece .model file; eod is its "<|endoftext|>" piece if any, else its eos id."""

    name = "SPMTokenizer"

    def __init__(self, vocab_file: str) -> None:
        try:
            import sentencepiece
        except ImportError as err:
            raise ImportError(
                "SPMTokenizer needs the sentencepiece package: pip install sentencepiece "
                "(or pip install 'neox[spm]')"
            ) from err
        require_file(vocab_file, "vocab_file", self.name)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=vocab_file)
        except (RuntimeError, OSError) as err:
            raise ValueError(
                f"SPMTokenizer: vocab_file={vocab_file!r} is not a SentencePiece model ({err}); "
                "set `vocab_file` to a .model file"
            ) from err
        # gpt-neox looks up "<|endoftext|>"; models without it (most) use their eos piece.
        eod = self._sp.piece_to_id(END_OF_TEXT)
        if eod == self._sp.unk_id() or self._sp.id_to_piece(eod) != END_OF_TEXT:
            eod = self._sp.eos_id()
        if eod < 0:
            raise ValueError(
                f"SPMTokenizer: vocab_file={vocab_file!r} has neither an {END_OF_TEXT!r} piece "
                "nor an eos id; train it with eos_id >= 0 or user_defined_symbols=<|endoftext|>"
            )
        self._eod = eod

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)
