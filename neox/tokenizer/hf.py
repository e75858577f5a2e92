"""Tokenizers from Hugging Face files: a tokenizers JSON, or transformers' GPT-2 tokenizer.

Threads: HFTokenizer's tiktoken path (byte-level BPE JSONs such as 20B's) encodes on the
calling thread. Otherwise `encode_batch` runs on the tokenizers library's own thread pool, which
uses every core unless TOKENIZERS_PARALLELISM=false. We leave that variable to the caller: one
process gets all cores; a tool that forks N encoding workers should set TOKENIZERS_PARALLELISM=false before it
forks, so the N workers use N cores rather than N x cores threads (and tokenizers does not warn
about, then disable, a pool the parent used before the fork).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Literal

from neox.tokenizer.base import Tokenizer, require_file

logger = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
PADDING = "<|padding|>"

Backend = Literal["auto", "tiktoken", "tokenizers"]


def _config_eos(vocab_file: str) -> str | None:
    """The eos_token of a transformers tokenizer_config.json beside vocab_file (Llama 3's
    <|end_of_text|>, Mistral's </s>): the end-of-document token of models that have no
    <|endoftext|>. None when there is no such file or it names none."""
    path = os.path.join(os.path.dirname(os.path.abspath(vocab_file)), "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):  # transformers' AddedToken form: {"content": ..., ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _without_quoted(message: str) -> str:
    """A JSON parser's error with the file's strings it quotes ("..." or `...`) blanked: a file
    passed by mistake may hold secrets, and the line and column already say where to look."""
    return re.sub(r'"(?:[^"\\]|\\.)*"|`[^`]*`', "<...>", message)


class HFTokenizer(Tokenizer):
    """A tokenizers-library JSON file (e.g. GPT-NeoX-20B's); eod is its "<|endoftext|>" token,
    else the eos_token of the tokenizer_config.json beside it (Llama 3, Mistral).

    Special tokens written in the text are encoded as their ids and kept by `decode`, so
    decode(encode(text)) gives the text back. Byte-level BPE JSONs like 20B's encode through
    tiktoken (neox/tokenizer/hf_tiktoken.py: same ids, about 3x faster on one core); other
    shapes, or backend="tokenizers", through the tokenizers library. `decode` always uses it.
    """

    name = "HFTokenizer"

    def __init__(self, vocab_file: str, backend: Backend = "auto") -> None:
        from tokenizers import Tokenizer as TokenizersBackend

        require_file(vocab_file, "vocab_file", self.name)
        try:
            self._tok = TokenizersBackend.from_file(vocab_file)
        except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(
                f"HFTokenizer: vocab_file={vocab_file!r} is not a tokenizers JSON file "
                f"({_without_quoted(str(err))}); "
                "set `vocab_file` to a tokenizer.json (tools/train_tokenizer.py writes one)"
            ) from err
        eod = self._tok.token_to_id(END_OF_TEXT)
        if eod is None:
            eod = self._tok.token_to_id(_config_eos(vocab_file) or END_OF_TEXT)
        if eod is None:
            raise ValueError(
                f"HFTokenizer: vocab_file={vocab_file!r} has no {END_OF_TEXT!r} token to use as "
                "eod, and no tokenizer_config.json beside it names an eos_token it has; train "
                "the tokenizer with it as a special token (tools/train_tokenizer.py does by "
                "default) or keep the model's tokenizer_config.json beside it"
            )
        self._eod = eod
        self.pad = self._tok.token_to_id(PADDING)
        # Not encode_batch_fast: on tokenizers 0.23 it measured ~25% slower single-threaded.
        self._encode_batch = self._tok.encode_batch
        self._fast = None
        if backend in ("auto", "tiktoken"):
            self._fast = _build_fast(self._tok, vocab_file, required=backend == "tiktoken")
        self.backend = "tiktoken" if self._fast is not None else "tokenizers"

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text)
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            # A plain loop, as in GPT2BPETokenizer: spread over cores with worker processes.
            encode = self._fast.encode
            return [encode(text) for text in texts]
        return [e.ids for e in self._encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def _build_fast(tok, vocab_file: str, required: bool):
    """The tiktoken encoder for this JSON, or None (reason logged) when it cannot be exact."""
    from neox.tokenizer.hf_tiktoken import TiktokenJsonEncoder

    # The library's own serialization: every default spelled out, in its current format.
    fast, reason = TiktokenJsonEncoder.build(tok, json.loads(tok.to_str()))
    if fast is None:
        if required:
            raise ValueError(
                f"HFTokenizer backend='tiktoken': {vocab_file!r} cannot be encoded exactly by "
                f"tiktoken ({reason}); use backend='tokenizers'"
            )
        logger.debug("HFTokenizer encodes %s with tokenizers: %s", vocab_file, reason)
    return fast


class HFGPT2Tokenizer(Tokenizer):
    """transformers' GPT2TokenizerFast plus a "<|padding|>" token, as gpt-neox builds it.

    `vocab_file` is a hub name or a local directory (default "gpt2", which downloads), or a
    vocab.json used with `merge_file`. The added pad token makes vocab_size 50258 for GPT-2.
    """

    name = "HFGPT2Tokenizer"

    def __init__(self, vocab_file: str | None = None, merge_file: str | None = None) -> None:
        try:
            from transformers import GPT2TokenizerFast
        except ImportError as err:
            raise ImportError(
                "HFGPT2Tokenizer needs transformers: pip install transformers "
                "(or use GPT2BPETokenizer with vocab_file and merge_file)"
            ) from err
        source = vocab_file or "gpt2"
        if os.path.isfile(source):
            require_file(merge_file, "merge_file", self.name)
            self._tok = _gpt2_from_files(GPT2TokenizerFast, source, merge_file)
        else:
            try:
                self._tok = GPT2TokenizerFast.from_pretrained(source)
            except OSError as err:
                raise OSError(
                    f"HFGPT2Tokenizer: cannot load {source!r} (vocab_file) with transformers "
                    f"({err}); offline, set `vocab_file` to a local vocab.json and `merge_file` "
                    "to its merges.txt, or to a directory holding both"
                ) from err
        self._tok.add_special_tokens({"pad_token": PADDING})
        self.pad = self._tok.pad_token_id
        self._eod = self._tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tok(texts)["input_ids"] if texts else []

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _gpt2_from_files(cls, vocab_file: str, merge_file: str):
    """Build GPT2TokenizerFast from a file pair; transformers 5 renamed the arguments."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    try:
        if "vocab" in params:
            return cls(vocab=vocab_file, merges=merge_file)
        return cls(vocab_file=vocab_file, merges_file=merge_file)
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(
            f"HFGPT2Tokenizer: vocab_file={vocab_file!r} and merge_file={merge_file!r} are not a "
            f"GPT-2 vocab.json and merges.txt ({_without_quoted(str(err))}); set them to "
            "the JSON token -> id map and its merges.txt"
        ) from err
