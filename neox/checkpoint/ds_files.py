"""The names of the files DeepSpeed (and gpt-neox, and neox before `state/`) writes in a
`global_stepN` directory: the one place neox knows them. Torch-free.

The model files depend on the layout that trained the run:
- pp = 1: `mp_rank_{t:02d}_model_states.pt`, tp rank t's module state dict under "module";
- pp > 1: `layer_{i:02d}-model_{t:02d}-model_states.pt`, one per pipeline layer and tp rank
  (layer 0 the embedding, 1..L the blocks, L+1 the final norm, L+2 an untied head; a tied head
  reuses layer 0 and has no file), plus one `mp_rank_{r:02d}_model_states.pt` per stage and tp
  rank carrying no module;
- ZeRO-3: `zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt`, whose module holds only empty
  placeholders (the weights are in the optimizer partitions).
The optimizer files: `[bf16_]zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt` per
data-parallel rank d.
"""

from __future__ import annotations

import re
from pathlib import Path

MODEL_STATES = "model_states.pt"
OPTIM_STATES = "optim_states.pt"
MP_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")
LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")
ZERO3_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
# DeepSpeed's ZeRO 1/2 engine reserves these keys of a model file; the rest is the client state.
ENGINE_KEYS = {
    *("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size"),
    *("data_sampler", "random_ltd", "lr_scheduler", "optimizer"),
}
# How the files are named in messages.
MP_FILES = "mp_rank_XX_model_states.pt"
LAYER_FILES = "layer_XX-model_YY-model_states.pt files"
ZERO3_FILES = "zero_pp_rank_X_mp_rank_YY_model_states.pt"
ANY_MODEL_FILES = f"{MP_FILES}, layer_XX-model_YY-model_states.pt or {ZERO3_FILES}"


def mp_file(rank: int) -> str:
    return f"mp_rank_{rank:02d}_{MODEL_STATES}"


def layer_file(index: int, tp_rank: int) -> str:
    return f"layer_{index:02d}-model_{tp_rank:02d}-{MODEL_STATES}"


def optim_file(dp_rank: int, bf16: bool, mp_rank: int = 0) -> str:
    return (
        "bf16_" if bf16 else ""
    ) + f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_{OPTIM_STATES}"


def optim_file_of(model_file: str | Path) -> str:
    """The ZeRO-3 optimizer file beside a zero_pp_rank_..._model_states.pt file."""
    return str(model_file).replace(MODEL_STATES, OPTIM_STATES)


def has_model_states(directory: Path) -> bool:
    """A directory holding DeepSpeed model files: one global_stepN checkpoint."""
    return any(directory.glob(f"*{MODEL_STATES}"))


def is_model_file(name: str) -> bool:
    return name.endswith(MODEL_STATES) or name.startswith("layer_")
