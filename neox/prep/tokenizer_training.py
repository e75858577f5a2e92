"""Train a byte-level BPE tokenizer (a tokenizers JSON that HFTokenizer loads) from text files."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|padding|>")
BYTE_ALPHABET_SIZE = 256


def train_bpe_tokenizer(
    inputs: Iterable[str],
    output: str | Path,
    vocab_size: int,
    special_tokens: Iterable[str] = DEFAULT_SPECIAL_TOKENS,
    jsonl_key: str = "text",
    progress: bool = False,
) -> Path:
    """Train byte-level BPE on the documents of `inputs` (files, dirs, globs) and save its JSON.

    Special tokens take the first ids in the order given, so with the defaults
    "<|endoftext|>" is 0 and "<|padding|>" is 1, as in GPT-NeoX-20B's tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from neox.prep.corpora import local_documents

    special_tokens = list(dict.fromkeys(special_tokens))  # drop repeats, keep order
    smallest = BYTE_ALPHABET_SIZE + len(special_tokens)
    if vocab_size < smallest:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the 256 byte tokens and "
            f"{len(special_tokens)} special tokens alone need {smallest}; use --vocab-size "
            f"{smallest} or more (GPT-2 uses 50257)"
        )
    documents = local_documents(list(inputs), jsonl_key)
    logger.info("training a %d-token BPE", vocab_size)

    tokenizer = Tokenizer(models.BPE())
    # GPT-2's byte-level scheme: no unknown tokens, and decoding restores the exact bytes.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # our document bar below replaces its own
    )
    tokenizer.train_from_iterator(_with_progress(documents, progress), trainer=trainer)

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output))
    logger.info("saved %d-token tokenizer to %s", tokenizer.get_vocab_size(), output)
    return output


def _with_progress(documents: Iterator[str], progress: bool) -> Iterator[str]:
    if not progress:
        return documents
    from tqdm import tqdm

    return iter(tqdm(documents, desc="reading documents", unit="doc"))
