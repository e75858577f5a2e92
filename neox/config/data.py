"""Training data and tokenizer."""

import math
from typing import Annotated, Literal, Optional

from pydantic import Field, field_validator, model_validator

from neox.config.base import MAX_VOCAB, ConfigGroup, Reads, Refused, Restricted
from neox.config.errors import ConfigError

TokenizerType = Literal[
    "GPT2BPETokenizer",
    "HFTokenizer",
    "HFGPT2Tokenizer",
    "SPMTokenizer",
    "CharLevelTokenizer",
    "TiktokenTokenizer",
]


# Per-document positions and masks stay inside the plain model's forward.
PIPELINE_INPUTS = Restricted(
    "Not with pipe_parallel_size > 1 (pipeline stages pass hidden states only).",
    example={"reset_position_ids": True, "reset_attention_mask": True},
    broken_by=({"pipe_parallel_size": 2, "gradient_clipping": 0},),
)

# A blending weight: the weights of a split are normalised, so any finite non-negative number.
Weight = Annotated[float, Field(ge=0, le=1e12)]


class TokenizerConfig(ConfigGroup):
    """Which tokenizer turns text into ids, and the vocabulary the model is built for."""

    tokenizer_type: Annotated[
        TokenizerType, Reads("neox/training/setup.py", "neox/plan/preflight.py")
    ] = "GPT2BPETokenizer"
    """Tokenizer class (gpt-neox names)."""

    vocab_file: Annotated[
        Optional[str], Reads("neox/training/setup.py", "neox/plan/preflight.py")
    ] = None
    """vocab.json (GPT2BPE), tokenizers JSON (HFTokenizer), or SentencePiece model (SPM)."""

    merge_file: Annotated[
        Optional[str], Reads("neox/training/setup.py", "neox/plan/preflight.py")
    ] = None
    """merges.txt for GPT2BPETokenizer."""

    padded_vocab_size: Annotated[Optional[int], Reads("neox/config/derived.py")] = Field(
        None, ge=1, le=MAX_VOCAB
    )
    """Model vocabulary; derived from the tokenizer when unset (rounded up to
    make_vocab_size_divisible_by x model_parallel_size). Set it to pin the size a checkpoint has."""


class DataConfig(ConfigGroup):
    """Where the tokenized (.bin/.idx) data lives and how samples are drawn."""

    data_path: Annotated[Optional[str], Reads("neox/data/loader.py", "neox/plan/preflight.py")] = (
        None
    )
    """Prefix of one dataset (path without .bin/.idx), split by `split`."""

    train_data_paths: Annotated[Optional[list[str]], Reads("neox/data/loader.py")] = None
    """Prefixes of training datasets, blended by train_data_weights."""

    valid_data_paths: Annotated[Optional[list[str]], Reads("neox/data/loader.py")] = None
    """Prefixes of validation datasets."""

    test_data_paths: Annotated[Optional[list[str]], Reads("neox/data/loader.py")] = None
    """Prefixes of test datasets."""

    label_data_paths: Annotated[
        Optional[list[str]], Reads("neox/data/loader.py", "neox/plan/preflight.py")
    ] = None
    """The label dataset of data_path (one prefix, written beside it by
    tools/preprocess_data_with_chat_template.py or _with_mask.py), split the same way: the
    token id where trained, -100 where not. With train_data_paths use train_label_data_paths."""

    train_label_data_paths: Annotated[Optional[list[str]], Reads("neox/data/loader.py")] = None
    """Label datasets of train_data_paths, one per path (gpt-neox key): the token id where
    trained, -100 where not (prompts, other roles); each must match its data path's document
    lengths."""

    valid_label_data_paths: Annotated[Optional[list[str]], Reads("neox/data/loader.py")] = None
    """Label datasets of valid_data_paths, one per path (validation loss on trained tokens)."""

    test_label_data_paths: Annotated[Optional[list[str]], Reads("neox/data/loader.py")] = None
    """Label datasets of test_data_paths, one per path."""

    train_data_weights: Annotated[Optional[list[Weight]], Reads("neox/data/loader.py")] = None
    """Blending weights of train_data_paths (default: equal)."""

    valid_data_weights: Annotated[Optional[list[Weight]], Reads("neox/data/loader.py")] = None
    """Blending weights of valid_data_paths."""

    test_data_weights: Annotated[Optional[list[Weight]], Reads("neox/data/loader.py")] = None
    """Blending weights of test_data_paths."""

    weight_by_num_documents: Annotated[bool, Reads("neox/data/loader.py")] = False
    """Weight datasets by document count, flattened by weighted_sampler_alpha (overrides weights)."""

    weighted_sampler_alpha: Annotated[float, Reads("neox/data/loader.py")] = Field(1.0, ge=0, le=1)
    """Exponent of the document-count weighting (1: proportional, 0: uniform)."""

    split: Annotated[str, Reads("neox/data/loader.py")] = "969,30,1"
    """Train/valid/test proportions of data_path's documents, e.g. "949,50,1"."""

    data_impl: Annotated[
        str,
        Refused(
            feature="only the mmap .bin/.idx format",
            example="cached",
            allowed=("mmap", "infer"),
            message=(
                "data_impl={value!r}: only the mmap .bin/.idx format is implemented in neox; use "
                "mmap (re-tokenize with tools/preprocess_data.py)"
            ),
        ),
    ] = "mmap"
    """No-op (gpt-neox key) for "mmap" and "infer": the mmap .bin/.idx format is the one format
    read (preflight checks each .idx header); gpt-neox's older "cached" format is refused."""

    dataset_impl: Annotated[
        str,
        Refused(
            feature="online datasets",
            example="online",
            allowed=("gpt2", "pairwise"),
            message=(
                "dataset_impl={value!r}: online datasets (RL) are not implemented in neox; use "
                "gpt2, or pairwise with train_impl dpo or rm"
            ),
        ),
    ] = "gpt2"
    """Dataset kind (gpt-neox key): "gpt2" (token windows; KTO's rewarded answers too) or
    "pairwise" (chosen/rejected pairs, what train_impl dpo and rm read); "online" is refused."""

    pack_impl: Annotated[
        Literal["packed", "pack_until_overflow", "unpacked"], Reads("neox/data/loader.py")
    ] = "packed"
    """How documents fill samples (gpt-neox key): "packed" cuts the document stream into
    windows of seq_length + 1 tokens that run across documents; "pack_until_overflow" lays
    whole documents into a sample until the next would overflow it, which starts the next
    sample; "unpacked" gives each document its own sample. The last two cut a longer
    document, pad the rest of a sample and never train on the padding, and skip documents
    with no trained label."""

    allow_chopped: Annotated[bool, Reads("neox/data/loader.py")] = True
    """With pack_impl pack_until_overflow or unpacked: cut documents longer than seq_length + 1
    tokens to their start (true) or leave them out (false). Ignored by "packed"."""

    eod_mask_loss: Annotated[bool, Reads("neox/training/loop.py")] = False
    """Exclude end-of-document tokens from the loss."""

    reset_position_ids: Annotated[bool, Reads("neox/training/loop.py"), PIPELINE_INPUTS] = False
    """Restart position ids at each document inside a sample."""

    reset_attention_mask: Annotated[bool, Reads("neox/training/loop.py"), PIPELINE_INPUTS] = False
    """Stop attention across documents inside a sample."""

    num_workers: Annotated[int, Reads("neox/data/loader.py")] = Field(2, ge=0, le=1024)
    """DataLoader worker processes per rank."""

    data_cache_dir: Annotated[Optional[str], Reads("neox/data/loader.py")] = None
    """Where sample indices are cached (default: beside the data)."""

    mmap_warmup: bool = False
    """No-op (gpt-neox key): gpt-neox ignores it too; pages are read on demand."""

    use_shared_fs: Annotated[bool, Reads("neox/data/loader.py")] = True
    """All nodes see the same data directory (index files are then built once, by global rank 0)."""

    short_seq_prob: float = Field(0.0, ge=0, le=1)
    """No-op (gpt-neox key): a BERT-era option gpt-neox does not read either."""

    @field_validator("label_data_paths")
    @classmethod
    def _one_label_dataset(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is not None and len(v) != 1:
            raise ValueError(
                f"label_data_paths has {len(v)} entries; it is the one label dataset of "
                "data_path (per-split paths take train/valid/test_label_data_paths)"
            )
        return v

    @field_validator("split")
    @classmethod
    def _split_form(cls, v: str) -> str:
        parse_split(v)
        return v

    @model_validator(mode="after")
    def _sources(self) -> "DataConfig":
        """Weights and label datasets match their paths; one way of naming the data."""
        for name in ("train", "valid", "test"):
            paths = getattr(self, f"{name}_data_paths")
            weights = getattr(self, f"{name}_data_weights")
            if weights is not None and not any(weights):
                raise ValueError(f"{name}_data_weights={weights} are all zero; give one weight > 0")
            if weights is not None and (paths is None or len(weights) != len(paths)):
                raise ValueError(
                    f"{name}_data_weights has {len(weights)} entries but {name}_data_paths has "
                    f"{0 if paths is None else len(paths)}; give one weight per path"
                )
        for name in ("train", "valid", "test"):
            paths = getattr(self, f"{name}_data_paths")
            labels = getattr(self, f"{name}_label_data_paths")
            if labels is not None and (paths is None or len(labels) != len(paths)):
                raise ValueError(
                    f"{name}_label_data_paths has {len(labels)} entries but {name}_data_paths "
                    f"has {0 if paths is None else len(paths)}; give one label dataset per data "
                    "path"
                )
        if self.label_data_paths and not self.data_path:
            raise ValueError(
                "label_data_paths is the label dataset of data_path, which is not set; with "
                "train/valid/test_data_paths use train/valid/test_label_data_paths"
            )
        if self.train_data_paths and self.data_path:
            raise ValueError(
                "data_path and train_data_paths are both set; use data_path (with split) or "
                "train/valid/test_data_paths, not both"
            )
        return self

    def check_run(self, pp: int, samples: tuple[int, int, int]) -> None:
        """Pipeline stages pass hidden states only (no per-document positions or masks); per-split
        data paths cover every split the run draws samples from (gpt-neox asks for all three),
        so the ranks never find a split missing after launch. Run by `derive`."""
        asked = [k for k in ("reset_position_ids", "reset_attention_mask") if getattr(self, k)]
        if pp > 1 and asked:
            raise ConfigError(
                f"{' and '.join(asked)} cannot be used with pipe_parallel_size={pp} "
                "(pipeline stages pass hidden states only); turn them off or use pipe_parallel_size 1"
            )
        if self.data_path or not self.train_data_paths:
            return
        for name, n, off in evaluated_splits(samples):
            if not getattr(self, f"{name}_data_paths"):
                raise ConfigError(
                    f"train_data_paths is set but {name}_data_paths is not, and the run evaluates "
                    f"{n} {name} samples; add {name}_data_paths (gpt-neox requires all three) or "
                    f"set {off}"
                )


def evaluated_splits(samples: tuple[int, int, int]) -> list[tuple[str, int, str]]:
    """(split, samples drawn, the setting that stops drawing them) of the valid and test splits a
    run evaluates on: the splits whose data a run's rules ask for."""
    off = {"valid": "do_valid: false (or eval_iters: 0)", "test": "do_test: false"}
    return [(name, n, off[name]) for name, n in zip(("valid", "test"), samples[1:]) if n]


def parse_split(split: str) -> list[float]:
    """Weights of train, valid and test from "949,50,1" (or "949/50/1"), normalised to sum to 1."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"split {split!r} must be up to three comma-separated numbers, e.g. '949,50,1'"
        ) from None
    if len(values) > 3:
        raise ValueError(f"split {split!r} has {len(values)} parts; give train,valid,test")
    values += [0.0] * (3 - len(values))
    if not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"split {split!r} must be non-negative numbers that are not all zero")
    total = sum(values)
    return [v / total for v in values]


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """[start, stop) document ranges of train, valid and test, contiguous and in that order.

    deepy.py checks the counts before launch with this same function the data loader cuts by.
    """
    bounds, total = [0], 0.0
    for weight in parse_split(split):
        total += weight
        bounds.append(int(round(total * num_documents)))  # round half to even, as numpy does
    bounds[-1] = num_documents  # rounding of the cumulative sum never drops the last document
    return [(bounds[i], bounds[i + 1]) for i in range(3)]
