"""What a job prints: each event said once.

Rank 0 speaks for the job; the other ranks only of themselves (their warnings and errors, named
by rank). Library notes that ask nothing of the user are dropped where they arise, narrowly, by
logger and message. `log_level: debug` (deepy.py --verbose) brings everything back.
"""

from __future__ import annotations

import logging
import warnings

# (logger, text in the message): notes a user can do nothing about.
LIBRARY_NOISE = (
    # torchao's optional CUDA kernels, absent from CPU wheels, on every import of transformers.
    ("torchao", "Failed to load "),
    # torchao registers its enums the way torch 2.13 deprecates, on the same imports.
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
    # DeepSpeed finding no GPU, which a tool on a CPU machine knows.
    ("DeepSpeed", "Setting accelerator to CPU"),
)
# (module, start of the message) of Python warnings: deprecations inside libraries, of calls
# that one library makes to another.
LIBRARY_WARNINGS = (
    # peft asks transformers 5 by the old name, when an adapter is loaded.
    ("transformers.modeling_utils", "`is_gradient_checkpointing` is deprecated"),
)


class _DropText(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_libraries() -> None:
    """Drop LIBRARY_NOISE's messages (a logger's filters apply whichever handler prints) and
    LIBRARY_WARNINGS."""
    for module, message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    for name, text in LIBRARY_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropText) and f.text == text for f in logger.filters):
            logger.addFilter(_DropText(text))


def configure_rank_logging(rank: int, level: str = "info") -> None:
    """Logging of one rank of a job: rank 0 at INFO, the others at WARNING with their rank in
    each line; `level` "debug": every rank at INFO, neox at DEBUG, no library note dropped."""
    verbose = level == "debug"
    who = "" if rank == 0 else f"rank {rank} "
    logging.basicConfig(
        level=logging.INFO if rank == 0 or verbose else logging.WARNING,
        format=f"%(asctime)s {who}%(name)s: %(message)s",
    )
    if verbose:
        logging.getLogger("neox").setLevel(logging.DEBUG)
    else:
        quiet_libraries()
