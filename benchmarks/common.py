"""What the training benchmarks share: the overlay on configs/pythia/<M>.yml (bf16, no
recompute, nothing saved), the 2-layer CPU shape of their smoke runs, and how a result is
reported, how inductor options given on the command line are set, and the environment of the
`deepy.py` (or other) child a benchmark starts."""

import json
import os
from typing import Any, Optional

import torch

from neox.launcher.plan import neox_pythonpath

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


def emit(record: dict[str, Any], json_path: Optional[str]) -> None:
    """Print one result as a JSON line, and append it to json_path if given."""
    line = json.dumps(record)
    print(line, flush=True)
    if json_path:
        with open(json_path, "a") as f:
            f.write(line + "\n")


def set_inductor_options(options: list[str]) -> None:
    """Set torch._inductor.config options given as key=value (dotted keys reach sub-configs,
    values are JSON or True/False), process-wide, before anything compiles."""
    for opt in options:
        key, value = opt.split("=", 1)
        obj = torch._inductor.config
        *path, last = key.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, json.loads(value.lower() if value in ("True", "False") else value))


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child, `extra` variables set on top: PYTHONPATH as the launcher
    gives its ranks (this checkout, then the caller's own: the device image keeps its packages
    there, and replacing it would hide them)."""
    return dict(os.environ, **extra, PYTHONPATH=neox_pythonpath(os.environ.get("PYTHONPATH", "")))
