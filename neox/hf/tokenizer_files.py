"""Write a run's tokenizer as Hugging Face tokenizer files, so AutoTokenizer loads the export.

A model imported from HF gets back the files convert_from_hf.py carried (tokenizer, generation
config, chat template) byte for byte, as long as the run still uses that tokenizer. Otherwise
transformers writes the files itself (save_pretrained), from the same vocabulary files the run
trained with; the end-of-document token becomes bos and eos, as in GPT-NeoX's HF exports.
"""

from __future__ import annotations

import filecmp
import logging
import shutil
from pathlib import Path
from typing import Optional

from neox.config import NeoXConfig
from neox.config.data import TokenizerConfig
from neox.tokenizer import Tokenizer
from neox.tokenizer.hf import PADDING, _gpt2_from_files

log = logging.getLogger(__name__)

EXPORTABLE = ("HFTokenizer", "GPT2BPETokenizer", "HFGPT2Tokenizer")

NOT_EXPORTABLE = {
    "CharLevelTokenizer": "it has no Hugging Face counterpart",
    "SPMTokenizer": "HF's SentencePiece tokenizers normalise text differently from ours",
    "TiktokenTokenizer": "tiktoken encodings have no tokenizers-library file",
}


def export_problem(t: TokenizerConfig) -> Optional[str]:
    """Why this tokenizer cannot be written as HF files, or None when it can."""
    kind = next((k for k in EXPORTABLE if k.lower() == t.tokenizer_type.lower()), None)
    if kind is not None:
        return None
    reason = NOT_EXPORTABLE.get(t.tokenizer_type, "it is not one of " + ", ".join(EXPORTABLE))
    return f"tokenizer_type={t.tokenizer_type} is not exported: {reason}"


def save_hf_tokenizer(t: TokenizerConfig, tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json (and GPT-2's vocab/merges) into `out`."""
    from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

    kind = t.tokenizer_type.lower()
    if kind == "hftokenizer":
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(t.vocab_file)
        eod = backend.id_to_token(tokenizer.eod)
        pad = getattr(tokenizer, "pad", None)
        hf = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=eod,
            eos_token=eod,
            unk_token=eod,
            pad_token=backend.id_to_token(pad) if pad is not None else None,
            model_max_length=max_length,
        )
    else:
        # GPT-2 BPE, built as HFGPT2Tokenizer builds it (with its padding token, if it adds one).
        if t.merge_file:
            hf = _gpt2_from_files(GPT2TokenizerFast, t.vocab_file, t.merge_file)
        else:
            hf = GPT2TokenizerFast.from_pretrained(t.vocab_file or "gpt2")
        if kind == "hfgpt2tokenizer":
            hf.add_special_tokens({"pad_token": PADDING})
        hf.model_max_length = max_length
    hf.save_pretrained(str(out))
    log.info("wrote %s tokenizer files to %s", t.tokenizer_type, out)


def carried_files(cfg: NeoXConfig) -> Optional[Path]:
    """The directory of HF files convert_from_hf.py carried (`hf_files`), when it is there and
    the run's tokenizer is its tokenizer.json; None otherwise (the files would pair the
    weights with another tokenizer's ids)."""
    if not cfg.checkpoint.hf_files:
        return None
    carried = Path(cfg.checkpoint.hf_files)
    t = cfg.tokenizer
    if not (carried / "config.json").is_file():
        log.warning("hf_files=%s holds no config.json; the HF files are not carried", carried)
        return None
    same = (
        t.tokenizer_type.lower() == "hftokenizer"
        and t.vocab_file is not None
        and (carried / "tokenizer.json").is_file()
        and Path(t.vocab_file).is_file()
        and filecmp.cmp(t.vocab_file, carried / "tokenizer.json", shallow=False)
    )
    if not same:
        log.warning(
            "the run's tokenizer is not the imported model's (%s): its tokenizer files, "
            "generation config and chat template are not carried",
            carried / "tokenizer.json",
        )
        return None
    return carried


def imported_files(cfg: NeoXConfig) -> Optional[Path]:
    """The carried HF files of a run that names no vocabulary file of its own (an import whose
    tokenizer neox cannot build, e.g. Llama 3's); None otherwise."""
    if cfg.tokenizer.vocab_file is not None or not cfg.checkpoint.hf_files:
        return None
    carried = Path(cfg.checkpoint.hf_files)
    return carried if (carried / "config.json").is_file() else None


def copy_carried_files(carried: Path, out: Path) -> None:
    """Every carried file but config.json (the export writes its own) into `out`."""
    for path in sorted(carried.iterdir()):
        if path.is_file() and path.name != "config.json":
            shutil.copyfile(path, out / path.name)
    log.info("wrote the imported model's tokenizer and generation files from %s", carried)
