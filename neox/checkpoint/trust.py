"""Read checkpoint files without running code planted in them.

A torch file is a pickle, and unpickling can call any importable function. Every read of a
checkpoint (resume, eval, generate, export, reshape) goes through torch's weights-only
unpickler, which only rebuilds tensors, containers and an allow-list of classes: exactly those
that neox's and DeepSpeed's own checkpoint files hold. A file needing anything else is refused,
naming the class; the user may opt in for a file they trust (`trust_checkpoint_code: true`, or
`--trust-checkpoint` for the tools).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from neox.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

TRUST_HINT = (
    "if you trust this file (it runs code when loaded), set `trust_checkpoint_code: true` "
    "(tools: --trust-checkpoint)"
)


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file holds objects a weights-only load does not rebuild."""


def allowed_globals() -> list[Any]:
    """The classes and functions neox's and DeepSpeed's checkpoint files pickle besides tensors."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    # train.py's client state holds numpy's RNG state; these rebuild exactly that array.
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed np.core
    numpy_rng = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    # DeepSpeed's optimizer files: the loss scaler, the ZeRO stage and each fragment's address.
    deepspeed = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    return numpy_rng + deepspeed


def load_file(path: str | Path, trust: bool = False, map_location: Any = "cpu", **kw: Any) -> Any:
    """torch.load of a checkpoint file: weights-only with the allow-list, unless `trust`.

    torch.serialization.load is torch.load itself; named so, it stays the real one while
    deepspeed_loads_safely routes `torch.load` here."""
    if trust:
        return torch.serialization.load(path, map_location=map_location, weights_only=False, **kw)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.serialization.load(
                path, map_location=map_location, weights_only=True, **kw
            )
    except pickle.UnpicklingError as e:
        reason = _unpickler_reason(str(e))
        raise UntrustedCheckpointError(
            f"{path} holds objects a weights-only load refuses ({reason}); it was not written "
            f"by neox or DeepSpeed, or was tampered with. Not loaded: {TRUST_HINT}"
        ) from None


def _unpickler_reason(message: str) -> str:
    """The line of torch's long message that names what was refused."""
    named = [line.strip() for line in message.splitlines() if "GLOBAL" in line]
    if named:
        return named[0].split(" Please use")[0].removeprefix("WeightsUnpickler error: ")
    return message.strip().split(".")[0]


def check_loadable(path: Path, trust: bool = False) -> None:
    """Unpickle `path` weights-only without reading its tensors (memory-mapped): quick."""
    if trust:
        return
    try:
        load_file(path, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        load_file(path)  # a legacy (non-zip) torch file cannot be memory-mapped


def load_inside(path: Any, root: Optional[Path], trust: bool, map_location: Any = None) -> Any:
    """load_file of a file that lies inside the checkpoint directory `root`, resolved: a symlink
    or `..` that leads out of it is refused, never followed."""
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(
            f"a checkpoint file was to be read from {type(path).__name__}, not a path inside "
            f"the checkpoint {root}; not loaded"
        )
    if root is not None:
        real, base = Path(os.path.realpath(path)), Path(os.path.realpath(root))
        if real != base and base not in real.parents:
            raise CheckpointError(
                f"{path} lies outside the checkpoint {root} (it resolves to {real}): a "
                "checkpoint's files must lie inside its directory; not loaded. Copy the files "
                "into it (no symbolic links)"
            )
    return load_file(path, trust, map_location=map_location)


@contextlib.contextmanager
def deepspeed_loads_safely(
    engine: Any, trust: bool = False, root: Optional[Path] = None
) -> Iterator[None]:
    """Every file DeepSpeed reads within this block goes through `load_inside(root)`.

    DeepSpeed's engine reads most checkpoint files through `engine.checkpoint_engine.load`, but
    other paths (universal checkpoints, ZeRO-3 and ZeRO optimizer state helpers) call
    `torch.load(weights_only=False)` themselves: both are routed here for the block's length.
    """

    def load(f: Any, map_location: Any = None, *args: Any, **kw: Any) -> Any:
        return load_inside(f, root, trust, map_location)

    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if ckpt_engine is not None:
        ckpt_engine.load = load
    real_load, torch.load = torch.load, load
    try:
        yield
    finally:
        torch.load = real_load
        if ckpt_engine is not None:
            del ckpt_engine.load  # the class's own method again
