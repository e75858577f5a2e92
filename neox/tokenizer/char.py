"""Character (UTF-8 byte) level tokenizer with gpt-neox's ids."""

from __future__ import annotations

from neox.tokenizer.base import Tokenizer

# gpt-neox builds CharLevelTokenizer(vocab_size=512) with eod 0: ids are the UTF-8 bytes of the
# text, so only 0..255 are ever produced; the rest of the 512 is headroom the model reserves.
CHAR_VOCAB_SIZE = 512
CHAR_EOD = 0


class CharLevelTokenizer(Tokenizer):
    """Ids are the UTF-8 bytes of the text (gpt-neox's CharLevelTokenizer, vocab 512, eod 0)."""

    name = "CharLevelTokenizer"

    @property
    def vocab_size(self) -> int:
        return CHAR_VOCAB_SIZE

    @property
    def eod(self) -> int:
        return CHAR_EOD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # gpt-neox maps each id to chr() separately, which garbles multi-byte characters;
        # decoding the bytes together makes decode the exact inverse of encode. Ids above 255
        # are never produced by encode (a model may still sample them): they become U+FFFD.
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append("\ufffd")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)
