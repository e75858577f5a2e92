"""Save and resume training: the engine's state by plain name (neox/checkpoint/plain_state.py),
the run's config beside it. Checkpoints in DeepSpeed's files (gpt-neox's, DeepSpeed's, neox's
before state/) are still read, through the engine's `load`."""

import copy
import errno
import logging
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from neox.adapters.base_record import base_reference, read_reference, write_reference
from neox.checkpoint import async_save
from neox.checkpoint.atomic import fsync_path, fsync_tree, kill_point, write_atomic
from neox.checkpoint.consolidate import lora_base_dir
from neox.checkpoint.ds_files import has_model_states
from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.find import (
    STAGING_SUFFIX,
    checkpoint_problem,
    find_checkpoint,
    read_latest,
    step_tags,
    tag_for,
)
from neox.checkpoint.lock import acquire
from neox.checkpoint.manifest import digests, files_in, read_manifest, write_manifest
from neox.checkpoint.plain_state import (
    Layout,
    PlainState,
    UniversalState,
    is_universal,
    saved_layout,
    weights_only,
    write_client_state,
    write_meta,
    write_pieces,
)
from neox.checkpoint.trust import check_loadable
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


def poisoned(nonfinite_in_a_row: int, iteration: int) -> bool:
    """True while a run of non-finite steps is in progress on any rank: the weights may hold
    NaN, so nothing is saved and `latest` stays on the last good checkpoint (all ranks agree)."""
    if not all_ranks_max(int(nonfinite_in_a_row > 0)):
        return False
    if torch.distributed.get_rank() == 0:
        log.warning(
            "not saving at iteration %d: the last %d step(s) had a non-finite loss or gradient",
            iteration,
            nonfinite_in_a_row,
        )
    return True


def last_saved(cfg: NeoXConfig) -> str:
    """Where a run can restart from: the checkpoint `latest` names in `save`, in words."""
    save = cfg.checkpoint.save
    tag = read_latest(Path(save)) if save else None
    return f"the last checkpoint saved is {Path(save) / tag}" if tag else "no checkpoint was saved"


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

    Every rank writes its part of the state by plain name into a staging directory (the engine's
    own files are not written); after a barrier rank 0 adds the
    config, the tokenizer files and a manifest, fsyncs, renames the directory into place and
    only then moves `latest` (by rename). A crash at any point leaves `latest` on a complete
    checkpoint. Assumes `save` is one directory all ranks share.
    """
    c = cfg.checkpoint
    save_dir = Path(c.save)
    rank = torch.distributed.get_rank()
    tag = tag_for(iteration)
    staging = save_dir / (tag + STAGING_SUFFIX)
    async_save.wait_for_save()  # a save still writing finishes first
    # Every rank stops on a problem found before anything is written; a failure while writing
    # stops the rank that met it, whose peers then fail in their next collective.
    problem = [save_problem(save_dir, staging) if rank == 0 else None]
    torch.distributed.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])
    state = dict(client_state, iteration=iteration)
    if not c.no_save_rng:
        state["rng"] = rng_state()
    if c.async_save:
        save_in_background(engine, cfg, iteration, state, staging, padded_vocab_size)
        return save_dir / tag
    try:
        known = save_plain_state(engine, staging, state)  # no `latest`: written below
    except Exception as e:
        failed_save(e, save_dir, staging)
        raise
    kill_point("shards", rank, iteration)
    torch.distributed.barrier()  # every rank's shards are written
    sums = shard_checksums(staging, known)
    if rank == 0:
        try:
            finish_save(cfg, staging, save_dir / tag, iteration, padded_vocab_size, sums)
        except Exception as e:
            failed_save(e, save_dir, staging)
            raise
        write_atomic(save_dir / "latest", tag)
        kill_point("latest", rank, iteration)
        write_config(cfg, save_dir / "config.yml")
        prune_checkpoints(save_dir, c.keep_last_n_checkpoints)
        log.info("saved checkpoint %s", save_dir / tag)
    torch.distributed.barrier()
    return save_dir / tag


def save_problem(save_dir: Path, staging: Path) -> Optional[str]:
    """Rank 0, before a save: why it cannot be made, or None. The directory must still be the
    one this run locked (never re-created: a second run may own the new one), writable (the
    staging directory is made here), and have room for a checkpoint as large as the last."""
    tag = staging.name.removesuffix(STAGING_SUFFIX)
    try:
        acquire(save_dir)  # held since the start (load_checkpoint): checks it is still ours
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
        staging.mkdir()
        free = shutil.disk_usage(save_dir).free
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return (
            f"saving checkpoint {tag} to {save_dir} failed: {e.strerror} ({e.filename}); "
            "nothing was written and the checkpoints there are untouched. Make the directory "
            "writable, or point `save` elsewhere, and resume"
        )
    latest = read_latest(save_dir)
    need = checkpoint_size(save_dir / latest) if latest else 0
    if free < need:
        shutil.rmtree(staging, ignore_errors=True)
        return no_space(tag, save_dir, free, need, "nothing was written")
    return None


def no_space(tag: str, save_dir: Path, free: Optional[int], need: int, done: str) -> str:
    room = "" if free is None else f"{free / 1e6:.1f} MB free, "
    room += f"about {need / 1e6:.1f} MB needed"
    return (
        f"saving checkpoint {tag} to {save_dir} failed: No space left on device ({room}); "
        f"{done}. Free space (keep_last_n_checkpoints deletes old checkpoints) or point `save` "
        "elsewhere"
    )


def checkpoint_size(step_dir: Path) -> int:
    """Bytes of a complete checkpoint, from its manifest (0 without one)."""
    manifest, _ = read_manifest(step_dir)
    return sum((manifest or {}).get("files", {}).values())


def causes(error: Optional[BaseException]) -> Iterator[BaseException]:
    """error, then its cause (or context), and so on."""
    seen = set()
    while error is not None and id(error) not in seen:
        yield error
        seen.add(id(error))
        error = error.__cause__ or error.__context__


def out_of_space(error: BaseException) -> bool:
    """ENOSPC anywhere in the chain of causes, or its text in a C++ error that lost errno."""
    return any(
        getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)
        for e in causes(error)
    )


def failed_save(error: Exception, save_dir: Path, staging: Path) -> None:
    """After a save failed with `error`: its partial directory is removed (it would fill the
    disk further), and a full disk or any other file-system error (a read-only or deleted
    directory) is raised as a one-line CheckpointError; other errors are left to the caller.

    torch.save reports a full disk as a C++ stream error ("basic_ios::clear") without errno;
    the save is taken as out of space too when, after removing the partial directory, the disk
    has less room than the last checkpoint took.
    """
    try:
        staged = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file())
    except OSError:  # another rank removed it first
        staged = 0
    shutil.rmtree(staging, ignore_errors=True)
    removed = "the partial save was removed" if not staging.exists() else f"{staging} is left"
    latest = read_latest(save_dir)
    need = max(staged, checkpoint_size(save_dir / latest) if latest else 0)
    try:
        free = shutil.disk_usage(save_dir).free
    except OSError:
        free = None
    tag = staging.name.removesuffix(STAGING_SUFFIX)
    if out_of_space(error) or (free is not None and free < need):
        raise CheckpointError(no_space(tag, save_dir, free, need, removed)) from error
    oserror = next((e for e in causes(error) if isinstance(e, OSError) and e.strerror), None)
    if oserror is not None:
        raise CheckpointError(
            f"saving checkpoint {tag} to {save_dir} failed: {oserror.strerror} "
            f"({oserror.filename}); {removed}, the checkpoints before it are untouched. Make "
            "the directory writable, or point `save` elsewhere, and resume"
        ) from error


def shard_checksums(staging: Path, known: dict[Path, str]) -> dict[str, str]:
    """Checksums of the staged shards (all ranks): those the ranks computed as they wrote
    (`known`, this rank's), then the other files', each rank hashing a share of them."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    sums = gathered({str(path.relative_to(staging)): digest for path, digest in known.items()})
    rest = [name for name in files_in(staging) if name not in sums]
    sums.update(gathered(digests(staging, rest[rank::world])))
    return sums


def gathered(mine: dict[str, str]) -> dict[str, str]:
    """Every rank's `mine`, merged (all ranks)."""
    shares: list[Optional[dict[str, str]]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shares, mine)
    return {name: digest for share in shares for name, digest in (share or {}).items()}


def finish_save(
    cfg: NeoXConfig,
    staging: Path,
    final: Path,
    iteration: int,
    padded_vocab_size: Optional[int],
    sums: Optional[dict[str, str]] = None,
) -> None:
    """Config, tokenizer files and manifest into the staged checkpoint, then rename it in place."""
    write_config(cfg, staging / "config.yml")
    if cfg.lora.lora_rank:
        write_reference(staging, base_reference(cfg, lora_base_dir(cfg), padded_vocab_size))
    t = cfg.tokenizer
    for src in (t.vocab_file, t.merge_file):
        if src and Path(src).is_file():
            (staging / "tokenizer").mkdir(exist_ok=True)
            shutil.copy2(src, staging / "tokenizer" / Path(src).name)
    write_manifest(staging, iteration, padded_vocab_size, known=sums)
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


def lock_save_dir(cfg: NeoXConfig) -> None:
    """Rank 0 locks `save` for the life of the run (neox.checkpoint.lock); every rank raises
    if another run holds it."""
    if cfg.checkpoint.save is None:
        return
    error: list[Optional[str]] = [None]
    if torch.distributed.get_rank() == 0:
        try:
            acquire(Path(cfg.checkpoint.save))
        except (CheckpointError, OSError) as e:
            error[0] = str(e)
    torch.distributed.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(error[0])


def verify_checkpoint(step_dir: Path, trust: bool) -> Optional[str]:
    """Why the checkpoint cannot be resumed (a checksum differs, a file does not read), or None.

    Reads every byte once; UntrustedCheckpointError for a file holding objects a weights-only
    load refuses (unless `trust`): a tampered checkpoint stops the run, it is not skipped.
    """
    problem = checkpoint_problem(step_dir, verify=True, allow_unverified=True)  # find decided
    if problem is not None:
        return problem
    # Every .pt file, however named: checkpoint_problem refused symbolic links, so rglob sees all.
    for path in sorted(step_dir.rglob("*.pt")):
        try:
            check_loadable(path, trust)
        except CheckpointError:
            raise
        except Exception as e:  # torch raises many kinds for a damaged file
            return f"{path} does not read ({type(e).__name__}: {str(e)[:200]})"
    return None


def verified_on_rank0(step_dir: Path, trust: bool) -> Optional[str]:
    """verify_checkpoint run once (rank 0), its answer (or its refusal) given to every rank."""
    answer: list[Any] = [None]
    if torch.distributed.get_rank() == 0:
        try:
            answer[0] = ("problem", verify_checkpoint(step_dir, trust))
        except CheckpointError as e:
            answer[0] = ("refused", str(e))
    torch.distributed.broadcast_object_list(answer, src=0)
    kind, text = answer[0]
    if kind == "refused":
        raise CheckpointError(text)
    return text


def check_adapter_base(step_dir: Path, cfg: NeoXConfig) -> None:
    """A resumed LoRA adapter must have been trained on the base (and adapter shape) this run
    loaded from lora_base."""

    saved = read_reference(step_dir)
    if saved is None:
        raise CheckpointError(
            f"{step_dir} holds a full model, not a LoRA adapter; to train an adapter on it set "
            "lora_base to it and point load/save at a new directory"
        )
    now = base_reference(cfg, lora_base_dir(cfg), saved.get("padded_vocab_size"))
    if saved != now:
        diffs = ", ".join(
            f"{k}: {saved.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(saved.keys() | now.keys())
            if saved.get(k) != now.get(k)
        )
        raise CheckpointError(
            f"the adapter in {step_dir} was trained on another base or adapter shape than this "
            f"run's ({diffs}); resume it with its own lora_base and lora_* keys, or point "
            "load/save at a new directory"
        )


def save_in_background(
    engine,
    cfg: NeoXConfig,
    iteration: int,
    state: dict[str, Any],
    staging: Path,
    padded_vocab_size: Optional[int],
) -> None:
    """async_save: the state by plain name copied to host memory now, written and published by
    a background thread (neox.checkpoint.async_save)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # Host copies the step may not touch (neox.checkpoint.host_staging); cut by name below.
    pieces, scalars = engine.plain_pieces()
    layout, state = engine.layout(), copy.deepcopy(state)
    engine_ranks = (rank, *engine.parallel_rank())
    save_dir, tag = staging.parent, staging.name.removesuffix(STAGING_SUFFIX)

    def write() -> None:
        try:
            files, known = write_part(staging, pieces, scalars, layout, state, engine_ranks)
            kill_point("async_write", rank, iteration)
            async_save.mark_done(staging, rank, files, known)
            if rank == 0:
                sums = async_save.gather_done(staging, world)
                finish_save(cfg, staging, save_dir / tag, iteration, padded_vocab_size, sums)
                write_atomic(save_dir / "latest", tag)
                write_config(cfg, save_dir / "config.yml")
                prune_checkpoints(save_dir, cfg.checkpoint.keep_last_n_checkpoints)
                log.info("saved checkpoint %s (written in the background)", save_dir / tag)
        except BaseException as e:
            async_save.mark_failed(staging, rank, e)
            if rank == 0:
                failed_save(e, save_dir, staging)  # a one-line CheckpointError where it can
            raise

    async_save.start(write)


def wait_for_saves() -> None:
    """The end of a run: the save still writing in the background completes (or raises)."""
    async_save.wait_for_save()


def save_plain_state(engine, staging: Path, client_state: dict[str, Any]) -> dict[Path, str]:
    """This rank's part of the training state by plain name (neox.checkpoint.plain_state); the
    checksums computed as it was written (its tensors' files)."""
    pieces, scalars = engine.plain_pieces()  # every rank (collective under ZeRO-3)
    ranks = (torch.distributed.get_rank(), *engine.parallel_rank())
    return write_part(staging, pieces, scalars, engine.layout(), client_state, ranks)[1]


def write_part(
    staging: Path,
    pieces: Callable[[], list],
    scalars: dict[str, Any],
    layout: Layout,
    client_state: dict[str, Any],
    ranks: tuple[int, int, int],
) -> tuple[list[Path], dict[Path, str]]:
    """This rank's files of a save (ranks: global, model-parallel, data-parallel): its pieces,
    the client state on data-parallel rank 0, the layout and scalars on rank 0. Returns the
    files and the checksums taken as the pieces were written."""
    rank, mp_rank, dp_rank = ranks
    known = write_pieces(staging, rank, pieces())
    files = list(known)
    if dp_rank == 0:
        files += write_client_state(staging, mp_rank, client_state)
    if rank == 0:
        files += write_meta(staging, layout, scalars)
    return files, known


def read_by_name(engine, step_dir: Path, finetune: bool) -> Optional[Layout]:
    """The layout that saved step_dir when the run reads it by plain name, else None (the
    engine's `load` reads DeepSpeed's files). By name: every checkpoint of state/ alone, and a
    DeepSpeed universal checkpoint. A checkpoint of neox before state/ became the only format
    carries both: its DeepSpeed files at the layout that saved them (every model-parallel rank's
    client state is there), else its state/ (a finetune reads the weights by name too)."""
    if is_universal(step_dir):
        return UniversalState.layout
    saved = saved_layout(step_dir)
    if saved is None or not has_model_states(step_dir):
        return saved
    return saved if finetune or saved != engine.layout() else None


def load_plain_state(
    engine, step_dir: Path, saved: Layout, cfg: NeoXConfig
) -> tuple[str, dict[str, Any]]:
    """Resume (or with finetune, take the weights) from step_dir's state by plain name; (path,
    client state)."""
    c = cfg.checkpoint
    finetune = cfg.training.finetune
    now = engine.layout()
    if torch.distributed.get_rank() == 0 and saved != now:
        log.info(
            "%s %s, saved by the %s, at this run's %s from its state by plain name",
            "loading the weights of" if finetune else "resuming",
            step_dir,
            saved.describe(),
            now.describe(),
        )
    same = (saved.tp, saved.pp) == (now.tp, now.pp)
    if is_universal(step_dir):
        state = UniversalState(step_dir, c.trust_checkpoint_code)
    else:
        # The client state is per model-parallel rank: this rank's own at the saved TP/PP.
        mp_rank = engine.parallel_rank()[0] if same else 0
        state = PlainState(step_dir, c.trust_checkpoint_code, mp_rank)
    if finetune:
        engine.load_plain(weights_only(state), load_optimizer_states=False)
        return str(state.dir), {}
    if isinstance(state, PlainState) and not (same and state.client_ranks == now.tp * now.pp):
        # Every rank read model-parallel rank 0's client state (another layout, or a checkpoint
        # saved before it was kept per rank): its tensors (DPO/KTO's reference weights) are
        # that rank's shard.
        client = state.client_state.items()
        sharded = sorted(k for k, v in client if k != "rng" and _holds_tensors(v))
        if sharded:
            raise CheckpointError(
                f"{step_dir} keeps {', '.join(sharded)} per tensor/pipeline rank (saved at "
                f"tp={saved.tp} pp={saved.pp}); resume it at that layout"
            )
    engine.load_plain(state, load_optimizer_states=not c.no_load_optim)
    return str(state.dir), dict(state.client_state)


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    return False


def load_checkpoint(engine, cfg: NeoXConfig) -> Optional[dict[str, Any]]:
    """Resume from cfg.checkpoint.load if it holds a checkpoint; returns its client state.

    The checkpoint `latest` names is used if it is complete and its checksums match, else the
    newest one that is (each skipped one is reported with the reason). No file is unpickled
    beyond tensors and the allow-list of neox.checkpoint.trust unless trust_checkpoint_code.
    """
    c = cfg.checkpoint
    lock_save_dir(cfg)
    if c.load is None:
        return None
    resume = find_checkpoint(c.load, c.allow_unverified_checkpoint)
    if torch.distributed.get_rank() == 0:
        for line in resume.report():
            log.warning(line)
    if resume.tag is None:
        if resume.skipped:
            raise CheckpointError(
                f"no checkpoint in load={c.load} can be loaded ({'; '.join(resume.report())}); "
                "point `load` at another directory, or remove it to start from scratch"
            )
        # deepy.py said so before the launch.
        log.debug("load=%s holds no checkpoint yet: starting from scratch", c.load)
        return None
    finetune = cfg.training.finetune
    from neox.checkpoint.relayout import checkpoint_for_run

    # finetune from another TP/PP loads a re-laid-out copy of the weights.
    zero3 = engine.partitions_weights()
    failures = []
    trust = c.trust_checkpoint_code
    for tag, problem in [(resume.tag, None), *resume.fallbacks]:
        if problem is None:
            problem = verified_on_rank0(Path(c.load) / tag, trust)
        if problem is not None:
            failures.append(f"{tag}: {problem}")
            if torch.distributed.get_rank() == 0:
                log.warning("skipping checkpoint %s", failures[-1])
            continue
        try:
            by_name = read_by_name(engine, Path(c.load) / tag, finetune)
            if by_name is not None:
                path, state = load_plain_state(engine, Path(c.load) / tag, by_name, cfg)
            else:
                with checkpoint_for_run(c.load, cfg, zero3, tag) as load_dir:
                    path, state = engine.load(
                        load_dir,
                        # A re-laid-out copy holds one checkpoint, named by its own `latest`.
                        tag=tag if load_dir == c.load else None,
                        load_optimizer_states=not (c.no_load_optim or finetune),
                        load_module_only=finetune,
                        trust=trust,
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
    if cfg.lora.lora_rank:
        check_adapter_base(Path(c.load) / tag, cfg)
    if finetune:
        # Weights only: nothing of the checkpoint's run resumes, so say so rather than
        # "resumed ... at iteration 0".
        log.info("loaded the weights of %s to finetune from iteration 0", path)
        return {"iteration": 0, "consumed_train_samples": 0}
    if not c.no_load_rng and "rng" in state:
        set_rng_state(state["rng"])
    log.info("resumed from %s at iteration %s", path, state.get("iteration"))
    return state
