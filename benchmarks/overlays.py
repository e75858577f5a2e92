"""What the training benchmarks lay over configs/pythia/<M>.yml: bf16, no recompute, nothing
saved (OVERLAY), and the 2-layer CPU shape of their smoke runs (TINY)."""

from typing import Any

OVERLAY: dict[str, Any] = {
    "bf16": {"enabled": True},
    "fp16": {"enabled": False},
    "checkpoint_activations": False,
    "partition_activations": False,
    "save": None,
    "load": None,
    "tensorboard_dir": None,
}

TINY: dict[str, Any] = {
    "num_layers": 2,
    "attention_config": [[["flash"], 2]],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "max_position_embeddings": 64,
    "tokenizer_type": "CharLevelTokenizer",
    "vocab_file": None,
    "bf16": {"enabled": False},
}
