"""Synthetic preference data for the DPO/KTO/RM tests, written as gpt-neox's chat-template tool
writes it: <prefix>_{chosen,rejected}_document and their _label_document files (the token where
trained, -100 where masked), and KTO's <prefix>_messages_{,label_,reward_}document.

The rule a model must learn: a prompt of PROMPT random tokens in 1..9, then SEP, then an answer
of one token. The chosen answer repeats the prompt's last token; the rejected one is another
token of 1..9. Prompt and SEP are masked (-100); the answer and the closing EOD are trained.
"""

from pathlib import Path

import numpy as np

from neox.data.indexed import IndexedDatasetBuilder

PROMPT, SEP, EOD, VOCAB = 4, 10, 0, 16


def conversation(rng: np.random.Generator) -> tuple[list[int], list[int], list[int]]:
    """(prompt + SEP, chosen answer, rejected answer) token lists."""
    prompt = rng.integers(1, 10, PROMPT).tolist()
    good = prompt[-1]
    bad = int(rng.choice([t for t in range(1, 10) if t != good]))
    return prompt + [SEP], [good, EOD], [bad, EOD]


def _write(prefix: str, docs: list[list[int]], dtype=np.int32) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def masked(context: list[int], answer: list[int]) -> tuple[list[int], list[int]]:
    return context + answer, [-100] * len(context) + answer


def write_pairs(directory: Path, name: str, n: int, seed: int = 0) -> dict[str, str]:
    """n chosen/rejected pairs; returns the config keys of one split (without the split)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sides: dict[str, tuple[list, list]] = {"chosen": ([], []), "rejected": ([], [])}
    for _ in range(n):
        context, chosen, rejected = conversation(rng)
        for side, answer in (("chosen", chosen), ("rejected", rejected)):
            tokens, labels = masked(context, answer)
            sides[side][0].append(tokens)
            sides[side][1].append(labels)
    out = {}
    for side, key in (("chosen", "pos"), ("rejected", "neg")):
        base = str(directory / f"{name}_{side}")
        out[f"{key}_data"] = _write(base + "_document", sides[side][0])
        out[f"{key}_label_data"] = _write(base + "_label_document", sides[side][1])
    return out


def write_rewarded(directory: Path, name: str, n: int, seed: int = 0) -> dict[str, str]:
    """KTO data: n answers, alternately desirable (reward 1) and undesirable (reward -1). KTO
    sees no pairs, so its rule is one it can learn from single answers: desirable answers are
    even tokens, undesirable ones odd. Only the answer token is trained: a trained EOD would be
    one token shared by every undesirable answer, pushed down in place of learning the rule."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens, labels, rewards = [], [], []
    for i in range(n):
        context, _, _ = conversation(rng)
        good = i % 2 == 0
        answer = int(rng.choice([2, 4, 6, 8] if good else [1, 3, 5, 7, 9]))
        t, lab = masked(context, [answer])
        tokens.append(t)
        labels.append(lab)
        rewards.append([1 if good else -1])
    base = str(directory / f"{name}_messages")
    return {
        "data": _write(base + "_document", tokens),
        "label_data": _write(base + "_label_document", labels),
        "reward_data": _write(base + "_reward_document", rewards),
    }


def pair_keys(directory: Path) -> dict[str, list[str]]:
    """Config keys of train/valid/test pairs under directory."""
    keys: dict[str, list[str]] = {}
    for split, n, seed in (("train", 256, 0), ("valid", 64, 1), ("test", 64, 2)):
        for k, prefix in write_pairs(directory, split, n, seed).items():
            side, rest = k.split("_", 1)
            keys[f"{side}_{split}_{rest}_paths"] = [prefix]
    return keys


def rewarded_keys(directory: Path) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for split, n, seed in (("train", 256, 0), ("valid", 64, 1), ("test", 64, 2)):
        for k, prefix in write_rewarded(directory, split, n, seed).items():
            keys[f"{split}_{k}_paths"] = [prefix]
    return keys
