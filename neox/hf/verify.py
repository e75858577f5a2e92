"""Check a Hugging Face directory against the neox checkpoint of the same model: an export
against the checkpoint it came from (convert_to_hf.py --verify), or an import's checkpoint
against the directory it was read from (convert_from_hf.py --verify).

transformers loads the directory (AutoModelForCausalLM, and AutoTokenizer when tokenizer files
were written); both models score the same tokens and decode greedily from the same prompt. The
pair is accepted when the logits agree within `atol` and the greedy tokens are identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from neox.checkpoint.consolidate import load_model

SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog.\ndef main():\n    return 0\n"


class VerifyError(ValueError):
    """transformers disagrees with neox on the exported model."""


@dataclass(frozen=True)
class Agreement:
    max_abs_logit_diff: float
    greedy_tokens: int
    tokenizer_checked: bool

    def describe(self) -> str:
        tok = "; tokenizer ids equal" if self.tokenizer_checked else ""
        return (
            f"transformers agrees with neox: max |logit difference| {self.max_abs_logit_diff:.2e}, "
            f"{self.greedy_tokens} greedy tokens identical{tok}"
        )


def _greedy(step, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Argmax continuation without a cache: both models run exactly the same computation."""
    for _ in range(new_tokens):
        nxt = step(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat((ids, nxt), dim=1)
    return ids


@torch.no_grad()
def verify_export(
    hf_dir: str | Path,
    checkpoint: str | Path,
    iteration: Optional[int] = None,
    text: str = SAMPLE_TEXT,
    atol: float = 1e-4,
    new_tokens: int = 8,
    trust: bool = False,
    hf_dtype: Optional[torch.dtype] = None,
    allow_unverified: bool = False,
) -> Agreement:
    """Compare neox's fp32 model with transformers' fp32 load of `hf_dir` on `text`.

    Args:
        hf_dtype: the dtype the checkpoint's weights were cast to from `hf_dir`'s (an import's
            --dtype): transformers' weights are rounded to it too before both run in fp32.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from neox.tokenizer import build_tokenizer

    model, cfg = load_model(
        checkpoint, iteration, "cpu", torch.float32, trust=trust, allow_unverified=allow_unverified
    )
    t = cfg.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=hf_dtype or torch.float32)
    hf = hf.float().eval()
    adapter = Path(hf_dir) / "adapter"
    if (adapter / "adapter_config.json").is_file():
        # A LoRA export in PEFT's format: the base plus the adapter, as users will load it.
        try:
            from peft import PeftModel
        except ImportError:
            raise VerifyError(
                f"{adapter} is a PEFT adapter; checking it needs `pip install peft`"
            ) from None
        hf = PeftModel.from_pretrained(hf, str(adapter)).eval()
    tokenizer_checked = (Path(hf_dir) / "tokenizer_config.json").is_file()
    try:
        tokenizer = build_tokenizer(t.tokenizer_type, t.vocab_file, t.merge_file)
        encode, vocab = tokenizer.encode, tokenizer.vocab_size
    except (ValueError, OSError):
        if not tokenizer_checked or t.vocab_file is not None:
            raise
        # An import whose tokenizer neox cannot build, exported with its own files: the
        # weights are compared on that tokenizer's ids.
        hf_tok = AutoTokenizer.from_pretrained(str(hf_dir))
        encode, vocab, tokenizer_checked = hf_tok.encode, hf.config.vocab_size, False
    ids = encode(text)[: cfg.model.shape.max_positions - new_tokens]
    if tokenizer_checked:
        hf_ids = AutoTokenizer.from_pretrained(str(hf_dir))(text)["input_ids"]
        if list(hf_ids[: len(ids)]) != list(ids):
            raise VerifyError(
                f"the exported tokenizer encodes {text!r} differently from neox's "
                f"({hf_ids[:12]}... vs {ids[:12]}...)"
            )
    x = torch.tensor([ids])
    ours = model(x)[..., :vocab]
    theirs = hf(x).logits[..., :vocab]
    diff = float((ours - theirs).abs().max())
    if not diff <= atol:
        raise VerifyError(f"logits differ by up to {diff:.3e} (allowed {atol:.0e}) on {hf_dir}")
    a = _greedy(lambda i: model(i)[..., :vocab], x, new_tokens)
    b = _greedy(lambda i: hf(i).logits[..., :vocab], x, new_tokens)
    if not torch.equal(a, b):
        raise VerifyError(
            f"greedy continuations differ: neox {a[0, -new_tokens:].tolist()} vs "
            f"transformers {b[0, -new_tokens:].tolist()}"
        )
    return Agreement(diff, new_tokens, tokenizer_checked)
