"""Save and resume training through DeepSpeed, with the run's config kept beside the weights."""

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from neox.checkpoint.atomic import fsync_path, fsync_tree, kill_point, write_atomic
from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.find import (
    MANIFEST,
    STAGING_SUFFIX,
    find_checkpoint,
    read_latest,
    step_tags,
    tag_for,
)
from neox.config import NeoXConfig, write_config
from neox.parallel.agree import all_ranks_max

log = logging.getLogger(__name__)


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


def save_checkpoint(
    engine,
    cfg: NeoXConfig,
    iteration: int,
    client_state: dict[str, Any],
    padded_vocab_size: Optional[int] = None,
) -> Path:
    """Write checkpoint `global_step<iteration>` to cfg.checkpoint.save, atomically.

    Every rank writes its shards into a staging directory; after a barrier rank 0 adds the
    config, the tokenizer files and a manifest, fsyncs, renames the directory into place and
    only then moves `latest` (by rename). A crash at any point leaves `latest` on a complete
    checkpoint. Assumes `save` is one directory all ranks share.
    """
    c = cfg.checkpoint
    save_dir = Path(c.save)
    rank = torch.distributed.get_rank()
    tag = tag_for(iteration)
    staging = save_dir / (tag + STAGING_SUFFIX)
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
    torch.distributed.barrier()
    state = dict(client_state, iteration=iteration)
    if not c.no_save_rng:
        state["rng"] = rng_state()
    engine.save(str(save_dir), staging.name, state)  # no `latest`: written below, atomically
    kill_point("shards", rank, iteration)
    torch.distributed.barrier()  # every rank's shards are written
    if rank == 0:
        finish_save(cfg, staging, save_dir / tag, iteration, padded_vocab_size)
        write_atomic(save_dir / "latest", tag)
        kill_point("latest", rank, iteration)
        write_config(cfg, save_dir / "config.yml")
        prune_checkpoints(save_dir, c.keep_last_n_checkpoints)
        log.info("saved checkpoint %s", save_dir / tag)
    torch.distributed.barrier()
    return save_dir / tag


def finish_save(
    cfg: NeoXConfig, staging: Path, final: Path, iteration: int, padded_vocab_size: Optional[int]
) -> None:
    """Config, tokenizer files and manifest into the staged checkpoint, then rename it in place."""
    write_config(cfg, staging / "config.yml")
    t = cfg.tokenizer
    for src in (t.vocab_file, t.merge_file):
        if src and Path(src).is_file():
            (staging / "tokenizer").mkdir(exist_ok=True)
            shutil.copy2(src, staging / "tokenizer" / Path(src).name)
    files = {
        str(p.relative_to(staging)): p.stat().st_size
        for p in sorted(staging.rglob("*"))
        if p.is_file()
    }
    manifest = {"iteration": iteration, "padded_vocab_size": padded_vocab_size, "files": files}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    fsync_tree(staging)
    kill_point("manifest", 0, iteration)
    if final.exists():
        # The same step saved again (e.g. a resumed run re-saving): the new copy wins.
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(final)
    fsync_path(final.parent)
    kill_point("renamed", 0, iteration)


def prune_checkpoints(save_dir: Path, keep: Optional[int]) -> None:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names)."""
    if not keep:
        return
    latest = read_latest(save_dir)
    for tag in step_tags(save_dir)[keep:]:
        if tag != latest:
            shutil.rmtree(save_dir / tag, ignore_errors=True)


def load_checkpoint(engine, cfg: NeoXConfig) -> Optional[dict[str, Any]]:
    """Resume from cfg.checkpoint.load if it holds a checkpoint; returns its client state.

    The checkpoint `latest` names is used if it is complete, else the newest complete one
    (each skipped one is reported with the reason).
    """
    c = cfg.checkpoint
    if c.load is None:
        return None
    resume = find_checkpoint(c.load)
    if torch.distributed.get_rank() == 0:
        for line in resume.report():
            log.warning(line)
    if resume.tag is None:
        if resume.skipped:
            raise CheckpointError(
                f"no checkpoint in load={c.load} can be loaded ({'; '.join(resume.report())}); "
                "point `load` at another directory, or remove it to start from scratch"
            )
        log.info("load=%s holds no checkpoint yet: starting from scratch", c.load)
        return None
    finetune = cfg.training.finetune
    from neox.checkpoint.relayout import checkpoint_for_run

    # finetune from another TP/PP loads a re-laid-out copy of the weights.
    zero3 = engine.partitions_weights()
    failures = []
    for tag, problem in [(resume.tag, None), *resume.fallbacks]:
        if problem is not None:
            failures.append(f"{tag}: {problem}")
            if torch.distributed.get_rank() == 0:
                log.warning("skipping checkpoint %s", failures[-1])
            continue
        try:
            with checkpoint_for_run(c.load, cfg, zero3) as load_dir:
                path, state = engine.load(
                    load_dir,
                    # A re-laid-out copy holds one checkpoint, named by its own `latest`.
                    tag=tag if load_dir == c.load else None,
                    load_optimizer_states=not (c.no_load_optim or finetune),
                    load_module_only=finetune,
                )
            error = None if path is not None else "DeepSpeed found no checkpoint files"
        except CheckpointError:
            raise  # a checkpoint this run cannot use at all (weights only, layout): not a fallback
        except Exception as e:  # DeepSpeed and torch raise many kinds; the user needs the file
            error = f"{type(e).__name__}: {e}"
        # Per-rank files differ (optimizer shards): every rank moves on if any one failed.
        if not all_ranks_max(error is not None):
            break
        failures.append(f"{tag}: {error or 'another rank could not load it'}")
        if torch.distributed.get_rank() == 0:
            log.warning("skipping checkpoint %s", failures[-1])
    else:
        raise CheckpointError(
            f"no checkpoint in load={c.load} loads ({'; '.join(failures)}); remove the broken "
            "ones or point `load` at another directory"
        )
    state = state or {}
    if finetune:
        state = {"iteration": 0, "consumed_train_samples": 0}
    elif not c.no_load_rng and "rng" in state:
        set_rng_state(state["rng"])
    log.info("resumed from %s at iteration %s", path, state.get("iteration"))
    return state
