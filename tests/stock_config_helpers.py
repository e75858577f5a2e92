"""The shipped model configs' own keys at test size: which configs stand for the others, and a
run config of one under a given layout (tests/parallel/test_stock_layouts.py on CPU ranks,
tests/parallel/test_multigpu.py on 4 GPUs).

A config's *features* are its keys other than sizes and run bookkeeping, as (key, value) pairs:
numbers become "#" (a learning rate or bucket size does not change what code runs; the ZeRO
stage does), sections are split into their sub-keys, and fp16/bf16 become the precision they
select. REPRESENTATIVES is a small set of shipped configs whose features cover every feature of
every shipped model config, so training each representative under a layout runs every key
value the shipped configs use under that layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neox.config.loader import read_config_file

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIRS = ("pythia", "llama", "llama2", "llama3", "mistral", "qwen2.5", "qwen3")
SETUPS = {"cpu.yml", "local_setup.yml", "tiny.yml"}  # configs/*.yml that are not model families

# Overridden by every stock run: shapes, tokenizer, layout, batch, schedule and I/O.
SIZE_KEYS = {
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "mlp_multiple_of",
    "seq_length",
    "max_position_embeddings",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
    "tokenizer_type",
    "vocab_file",
    "merge_file",
}
RUN_KEYS = {
    "pipe_parallel_size",
    "model_parallel_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "train_iters",
    "lr_decay_iters",
    "checkpoint_factor",
    "extra_save_iters",
    "keep_last_n_checkpoints",
    "eval_interval",
    "eval_iters",
    "log_interval",
    "steps_per_print",
    "split",
    "num_workers",
    "train_data_paths",
    "valid_data_paths",
    "test_data_paths",
}
# Scaled down where a file sets them, but their presence is a feature (numbers count as "#").
SCALED_KEYS = {
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "sliding_window_width",
    "rope_original_max_position_embeddings",
    "attention_config",
}
# Numbers that choose a code path rather than a magnitude.
PATH_NUMBERS = {"zero_optimization.stage"}

# A greedy cover, largest first; each line says what it adds to the ones above it
# (tests/parallel/test_stock_layouts.py checks that they cover every shipped model config).
REPRESENTATIVES = (
    "configs/pythia/1B.yml",  # Pythia's keys: bf16-typed fp16 section, ZeRO stage 0, fusions,
    # partitioned activation checkpoints, wall-clock timers, small_init/wang_init
    "configs/llama3/8B.yml",  # Llama 3: GQA, SwiGLU, RMSNorm, no biases, llama3 RoPE scaling, fp32
    "configs/19M.yml",  # the GPT-NeoX series: fp16, ZeRO-1, DeepSpeed's comms_logger
    "configs/qwen3/0-6B.yml",  # QK-norm, a head_dim other than hidden / heads
    "configs/mistral/7B.yml",  # a sliding window
    "configs/qwen2.5/7B.yml",  # q/k/v biases without the attention output's
)


def shipped_model_configs() -> list[str]:
    """Every shipped model family config (not the setups, finetuning or post-training files)."""
    found = [p for d in MODEL_DIRS for p in (ROOT / "configs" / d).glob("*.yml")]
    found += [p for p in (ROOT / "configs").glob("*.yml") if p.name not in SETUPS]
    return sorted(str(p.relative_to(ROOT)) for p in found if not _is_moe(p))


def _is_moe(path: Path) -> bool:
    """Mixture-of-experts configs are refused under pipeline parallelism, so their layouts are
    tests/training/test_moe_train.py's (TP, EP, ZeRO-1/2/3), not this matrix's."""
    return (read_config_file(path).get("moe_num_experts") or 1) > 1


def _precision(keys: dict[str, Any]) -> str:
    fp16, bf16 = keys.get("fp16") or {}, keys.get("bf16") or {}
    if fp16.get("enabled") and fp16.get("type") not in ("bfloat16", "bf16"):
        return "fp16"
    if fp16.get("enabled") or bf16.get("enabled"):
        return "bf16"
    return keys.get("precision") or "fp32"


def _pairs(prefix: str, value: Any) -> set[tuple[str, str]]:
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in _pairs(f"{prefix}.{k}", v)}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {(prefix, repr(value) if prefix in PATH_NUMBERS else "#")}
    if isinstance(value, list):  # attention_config's [[types], layers]: the types matter
        return {(prefix, repr(_numbers_hidden(value)))}
    return {(prefix, repr(value))}


def _numbers_hidden(value: Any) -> Any:
    if isinstance(value, list):
        return [_numbers_hidden(v) for v in value]
    return "#" if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _defaults() -> dict[str, Any]:
    from neox.config.schema import GROUPS

    return {k: f.default for cls in GROUPS.values() for k, f in cls.model_fields.items()}


def features(name: str) -> set[tuple[str, str]]:
    """(key, value) pairs of a shipped config other than its sizes and run keys, and other than
    a key set to its default (the same code path as leaving it out)."""
    keys, defaults = read_config_file(ROOT / name), _defaults()
    out = {("precision", _precision(keys))}
    for key, value in keys.items():
        if key in SIZE_KEYS | RUN_KEYS | {"fp16", "bf16", "precision"}:
            continue
        if key in defaults and defaults[key] == value:
            continue
        out |= _pairs(key, value)
    return out


# Layout name -> keys; ZeRO stages merge into the config's own zero_optimization section.
LAYOUTS_2: dict[str, dict[str, Any]] = {
    "pp2": {"pipe_parallel_size": 2, "model_parallel_size": 1},
    "tp2": {"pipe_parallel_size": 1, "model_parallel_size": 2},
    "zero1": {"pipe_parallel_size": 1, "model_parallel_size": 1, "zero_stage": 1},
    "zero2": {"pipe_parallel_size": 1, "model_parallel_size": 1, "zero_stage": 2},
    "zero3": {"pipe_parallel_size": 1, "model_parallel_size": 1, "zero_stage": 3},
}


def stock_keys(
    name: str,
    layout: dict[str, Any],
    *,
    num_gpus: int,
    hidden: int = 32,
    heads: int = 4,
    layers: int = 2,
    seq: int = 32,
    cpu: bool = True,
) -> dict[str, Any]:
    """The config file's own keys with only sizes, tokenizer, layout and schedule replaced:
    a char-level model `layers` deep and `hidden` wide (GQA, head_dim, gated MLP widths and
    sliding windows kept where the file has them, at this scale).

    On CPU ranks fp16 becomes bf16: DeepSpeed's CPU accelerator has no fp16."""
    cfg = read_config_file(ROOT / name)
    for key in ("padded_vocab_size", "merge_file", "train_data_paths", "valid_data_paths"):
        cfg.pop(key, None)
    cfg.pop("test_data_paths", None)
    cfg |= {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "seq_length": seq,
        "max_position_embeddings": seq,
        "tokenizer_type": "CharLevelTokenizer",
        "vocab_file": None,
        "make_vocab_size_divisible_by": 8,
    }
    if "num_kv_heads" in cfg:  # grouped queries stay grouped
        cfg["num_kv_heads"] = heads // 2
    if "head_dim" in cfg:  # a head_dim other than hidden / heads stays other
        cfg["head_dim"] = 2 * hidden // heads
    if "intermediate_size" in cfg:  # gated MLPs: a third of it, halved, is the FFN width
        cfg["intermediate_size"] = 6 * hidden
    if "mlp_multiple_of" in cfg:
        cfg["mlp_multiple_of"] = 8
    if "sliding_window_width" in cfg:  # a window shorter than the sequence, so it masks
        cfg["sliding_window_width"] = seq // 4 - 1
    if "rope_original_max_position_embeddings" in cfg:  # the scaling still stretches
        cfg["rope_original_max_position_embeddings"] = seq // 4
    if "attention_config" in cfg:  # the file's attention types, over the reduced depth
        cfg["attention_config"] = [[types, layers] for types, _ in cfg["attention_config"]][:1]
    layout = dict(layout)
    stage = layout.pop("zero_stage", None)
    if stage is not None:
        cfg["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "stage": stage}
    cfg |= layout | {"num_gpus": num_gpus}
    if cpu and _precision(cfg) == "fp16":
        cfg["fp16"] = {**cfg["fp16"], "enabled": False}
        cfg["bf16"] = {"enabled": True}
    return cfg
