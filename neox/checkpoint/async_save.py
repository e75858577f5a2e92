"""async_save: the training step waits only for the copy of the state to host memory; a
background thread per rank writes it, and rank 0's publishes the checkpoint once every rank's
files are complete.

The thread makes no collective call (it would race the training step's on the same process
group): each rank marks its files done with a small file naming their checksums
(`state/rank_RRRRR.done`, written by rename), and rank 0's thread waits for all of them (or a
`.failed` one) before it writes the manifest, renames the staging directory into place and
moves `latest`, as a synchronous save does. A kill -9 at any point leaves the `.partial`
directory unpublished: `latest` stays on the last complete checkpoint, and the next run removes
it. A second save, and the end of the run, first wait for the one in flight.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from neox.checkpoint.atomic import write_atomic
from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.find import PLAIN_STATE
from neox.checkpoint.manifest import digests

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often rank 0 looks for the other ranks' done files


class _Pending:
    def __init__(self, work: Callable[[], None]) -> None:
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(work,), daemon=True)
        self.thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # raised in the training thread by wait_for_save
            self.error = e


_pending: Optional[_Pending] = None


def start(work: Callable[[], None]) -> None:
    """Run `work` (this rank's writing, and on rank 0 the publishing) in the background."""
    global _pending
    wait_for_save()
    _pending = _Pending(work)


def wait_for_save() -> None:
    """Wait for this rank's save in flight, if any; raise its error."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    pending.thread.join()
    if pending.error is not None:
        raise pending.error


def marker(staging: Path, rank: int, kind: str) -> Path:
    return staging / PLAIN_STATE / f"rank_{rank:05d}.{kind}"


def mark_done(
    staging: Path, rank: int, files: list[Path], known: Optional[dict[Path, str]] = None
) -> None:
    """This rank's files are complete: their checksums (those not `known` from the write
    computed now), in a file written by rename."""
    known = known or {}
    sums = digests(staging, [str(f.relative_to(staging)) for f in files if f not in known])
    sums.update({str(f.relative_to(staging)): known[f] for f in files if f in known})
    write_atomic(marker(staging, rank, "done"), json.dumps(sums))


def mark_failed(staging: Path, rank: int, error: BaseException) -> None:
    try:
        write_atomic(marker(staging, rank, "failed"), f"{type(error).__name__}: {error}")
    except OSError:
        pass  # the staging directory is gone: rank 0 stops on that


def gather_done(staging: Path, world: int) -> dict[str, str]:
    """Rank 0: wait until every rank marked its files done; their checksums. The markers are
    removed (they are not part of the checkpoint)."""
    sums: dict[str, str] = {}
    for rank in range(world):
        done, failed = marker(staging, rank, "done"), marker(staging, rank, "failed")
        while not done.is_file():
            if failed.is_file():
                raise CheckpointError(
                    f"rank {rank} could not write its part of {staging.name}: "
                    f"{failed.read_text()}; the checkpoints before it are untouched"
                )
            if not staging.is_dir():
                raise CheckpointError(f"{staging} was removed while it was being written")
            time.sleep(POLL_S)
        sums.update(json.loads(done.read_text()))
    for rank in range(world):
        marker(staging, rank, "done").unlink()
    return sums
