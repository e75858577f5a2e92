"""Change a checkpoint's TP/PP: offline (tools/reshape_checkpoint.py) or when a `finetune: true`
run loads weights trained at another layout.

The offline reshape carries the training state by plain name (state/, optimizer included) when
the checkpoint has one, so its output resumes; a finetune moves weights only.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from neox.checkpoint.consolidate import (
    CheckpointError,
    load_model_state,
    read_checkpoint_config,
    resolve_checkpoint,
)
from neox.checkpoint.ds_files import ZERO3_FILE
from neox.checkpoint.find import TAG_PREFIX, has_plain_state, read_latest
from neox.checkpoint.staging import check_output_dir, staged_directory
from neox.checkpoint.writer import (
    WEIGHTS_ONLY,
    check_layout,
    resize_vocab_rows,
    with_layout,
    write_checkpoint,
)
from neox.config import NeoXConfig
from neox.config.derived import padded_vocab
from neox.tokenizer.build import build_run_tokenizer

log = logging.getLogger(__name__)


def reshape_checkpoint(
    input_dir: str | Path,
    output_dir: str | Path,
    tp: int,
    pp: int,
    *,
    iteration: Optional[int] = None,
    overwrite: bool = False,
    trust: bool = False,
    allow_unverified: bool = False,
    weights_only: bool = False,
) -> Path:
    """Write the checkpoint's weights at tp/pp into output_dir (its iteration kept), with its
    training state by plain name unless `weights_only` (or it has none); returns the new
    global_stepN directory. The vocabulary rows follow the new tp's padding."""
    tag_dir = resolve_checkpoint(input_dir, iteration, allow_unverified=allow_unverified)
    saved = read_checkpoint_config(tag_dir)
    check_layout(saved, tp, pp)
    try:
        cfg = with_layout(saved, tp, pp)
        rows = padded_vocab(cfg, build_run_tokenizer(cfg.tokenizer).vocab_size)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"cannot re-lay out {tag_dir}: {e}") from None
    check_output_dir(Path(output_dir), overwrite, protected=[tag_dir])
    _, sd = load_model_state(tag_dir, config=saved, trust=trust, allow_unverified=allow_unverified)
    sd = resize_vocab_rows(sd, rows)
    step = int(tag_dir.name.removeprefix(TAG_PREFIX))
    with staged_directory(Path(output_dir), overwrite) as tmp:
        carry = None if weights_only or not has_plain_state(tag_dir) else tag_dir
        write_checkpoint(sd, cfg, tmp, step, state_from=carry)
    return Path(output_dir) / tag_dir.name


def _layout(cfg: NeoXConfig) -> tuple[int, int]:
    return cfg.parallel.model_parallel_size, cfg.parallel.pp


@contextlib.contextmanager
def checkpoint_for_run(
    load_dir: str, cfg: NeoXConfig, zero3: bool, tag: Optional[str] = None
) -> Iterator[str]:
    """The directory this run's engine.load_checkpoint should read for checkpoint `tag` (None:
    the one `latest` names): `load_dir` itself, or for a finetune run at another TP/PP (or
    ZeRO-3 files for a ZeRO 0-2 run) a re-laid-out copy that rank 0 writes (in the run's save
    directory, else beside load_dir) and removes after the load."""
    import torch.distributed as dist

    tag = tag or read_latest(Path(load_dir))
    if not cfg.training.finetune:
        tag_dir = Path(load_dir) / (tag or "")
        if tag and (tag_dir / WEIGHTS_ONLY).exists():
            raise CheckpointError(
                f"{tag_dir} holds weights only (written by a conversion tool), nothing to resume "
                "training from; set `finetune: true` to start a run from these weights"
            )
        yield load_dir
        return
    allow_unverified = cfg.checkpoint.allow_unverified_checkpoint
    tag_dir = resolve_checkpoint(
        Path(load_dir) / (tag or ""), require_config=False, allow_unverified=allow_unverified
    )
    if not (tag_dir / "config.yml").is_file():
        yield load_dir  # not written by train.py: its layout is unknown, DeepSpeed loads it as is
        return
    saved = read_checkpoint_config(tag_dir)
    saved_zero3 = any(ZERO3_FILE.match(p.name) for p in tag_dir.iterdir())
    if _layout(saved) == _layout(cfg) and saved_zero3 == zero3:
        yield load_dir
        return
    if zero3:
        raise CheckpointError(
            f"{tag_dir} was trained at tp={saved.parallel.model_parallel_size} "
            f"pp={saved.parallel.pp}{' with ZeRO-3' if saved_zero3 else ''}; a ZeRO-3 run only "
            "finetunes from its own layout: finetune at ZeRO stage 0-2, or train it at that layout"
        )
    tp, pp = _layout(cfg)
    # Inside this run's save directory (it writes there anyway), else beside the checkpoint.
    base = Path(cfg.checkpoint.save) if cfg.checkpoint.save else Path(load_dir).resolve().parent
    relaid = base / f".{Path(load_dir).name}.tp{tp}-pp{pp}"
    error = [None]
    if dist.get_rank() == 0:
        try:
            log.info(
                "re-laying out %s (tp=%d pp=%d) to tp=%d pp=%d in %s",
                tag_dir,
                *_layout(saved),
                tp,
                pp,
                relaid,
            )
            shutil.rmtree(relaid, ignore_errors=True)
            rows = padded_vocab(cfg, build_run_tokenizer(cfg.tokenizer).vocab_size)
            trust = cfg.checkpoint.trust_checkpoint_code
            _, sd = load_model_state(
                tag_dir, config=saved, trust=trust, allow_unverified=allow_unverified
            )
            sd = resize_vocab_rows(sd, rows)
            write_checkpoint(sd, with_layout(saved, tp, pp), relaid, 0)
        except Exception as e:  # every rank raises it below, rather than waiting forever
            error[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(f"could not re-lay out {tag_dir} for this run: {error[0]}")
    try:
        yield str(relaid)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(relaid, ignore_errors=True)
