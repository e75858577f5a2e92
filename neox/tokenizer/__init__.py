"""Tokenizers behind one interface, built from gpt-neox's tokenizer_type/vocab_file/merge_file."""

from neox.tokenizer.base import Tokenizer
from neox.tokenizer.build import TOKENIZER_TYPES, build_tokenizer
from neox.tokenizer.char import CharLevelTokenizer
from neox.tokenizer.gpt2 import GPT2BPETokenizer
from neox.tokenizer.hf import HFGPT2Tokenizer, HFTokenizer
from neox.tokenizer.named_tiktoken import TiktokenTokenizer
from neox.tokenizer.spm import SPMTokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "CharLevelTokenizer",
    "GPT2BPETokenizer",
    "HFGPT2Tokenizer",
    "HFTokenizer",
    "SPMTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "build_tokenizer",
]
