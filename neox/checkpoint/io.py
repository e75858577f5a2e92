"""Save and resume training through DeepSpeed, with the run's config kept beside the weights."""

import logging
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from neox.config import NeoXConfig, write_config

log = logging.getLogger(__name__)

TAG_PREFIX = "global_step"


def tag_for(iteration: int) -> str:
    return f"{TAG_PREFIX}{iteration}"


def should_save(cfg: NeoXConfig, iteration: int) -> bool:
    """checkpoint_factor (linear or log scale) and extra_save_iters decide."""
    c = cfg.checkpoint
    if c.save is None:
        return False
    if iteration in (c.extra_save_iters or []):
        return True
    factor = c.checkpoint_factor
    if not factor or iteration == 0:
        return False
    if c.checkpoint_scale == "linear":
        return iteration % factor == 0
    power = factor
    while power < iteration:
        power *= factor
    return power == iteration


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(engine, cfg: NeoXConfig, iteration: int, client_state: dict[str, Any]) -> Path:
    """Write checkpoint `global_step<iteration>` to cfg.checkpoint.save; `latest` moves last."""
    c = cfg.checkpoint
    save_dir = Path(c.save)
    state = dict(client_state, iteration=iteration)
    if not c.no_save_rng:
        state["rng"] = rng_state()
    tag = tag_for(iteration)
    # DeepSpeed writes the tag directory first and the `latest` file after it, so a crash
    # mid-save leaves `latest` on the previous, complete checkpoint.
    engine.save_checkpoint(
        str(save_dir), tag=tag, client_state=state, exclude_frozen_parameters=False
    )
    if torch.distributed.get_rank() == 0:
        write_config(cfg, save_dir / tag / "config.yml")
        write_config(cfg, save_dir / "config.yml")
        prune_checkpoints(save_dir, c.keep_last_n_checkpoints)
        log.info("saved checkpoint %s", save_dir / tag)
    torch.distributed.barrier()
    return save_dir / tag


def prune_checkpoints(save_dir: Path, keep: Optional[int]) -> None:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names)."""
    if not keep:
        return
    latest = (save_dir / "latest").read_text().strip() if (save_dir / "latest").exists() else None
    steps = sorted(
        (int(p.name[len(TAG_PREFIX) :]), p)
        for p in save_dir.glob(f"{TAG_PREFIX}*")
        if p.is_dir() and p.name[len(TAG_PREFIX) :].isdigit()
    )
    for _, path in steps[:-keep]:
        if path.name != latest:
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(engine, cfg: NeoXConfig) -> Optional[dict[str, Any]]:
    """Resume from cfg.checkpoint.load if it holds a checkpoint; returns its client state."""
    c = cfg.checkpoint
    if c.load is None or not (Path(c.load) / "latest").is_file():
        if c.load is not None:
            log.info("load=%s holds no checkpoint yet: starting from scratch", c.load)
        return None
    finetune = cfg.training.finetune
    from neox.checkpoint.relayout import checkpoint_for_run

    # finetune from another TP/PP loads a re-laid-out copy of the weights.
    zero3 = engine.zero_optimization_partition_weights()
    with checkpoint_for_run(c.load, cfg, zero3) as load_dir:
        path, state = engine.load_checkpoint(
            load_dir,
            load_optimizer_states=not (c.no_load_optim or finetune),
            load_lr_scheduler_states=False,
            load_module_only=finetune,
        )
    if path is None:
        raise RuntimeError(
            f"DeepSpeed could not load the checkpoint in {c.load}; check that its `latest` "
            "file names a complete checkpoint directory"
        )
    state = state or {}
    if finetune:
        state = {"iteration": 0, "consumed_train_samples": 0}
    elif not c.no_load_rng and "rng" in state:
        set_rng_state(state["rng"])
    log.info("resumed from %s at iteration %s", path, state.get("iteration"))
    return state
