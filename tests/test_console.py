"""neox/console.py: rank 0 speaks for the job, other ranks only of their warnings, library notes
dropped by logger and message; log_level debug brings everything back. Each case is a fresh
interpreter (pytest's own log handlers would make logging.basicConfig a no-op here)."""

import subprocess
import sys

import pytest

from tests.train_helpers import ROOT

# A rank's lines: its own info and warning, neox debug, and library notes (one kept: a torchao
# message that is not the dropped one).
RANK = """
import logging, sys
from neox.console import configure_rank_logging
configure_rank_logging(int(sys.argv[1]), sys.argv[2])
logging.getLogger("neox.x").info("job info")
logging.getLogger("neox.x").debug("neox debug")
logging.getLogger("neox.x").warning("own warning")
logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: no CUDA")
logging.getLogger("torchao").warning("torchao says something else")
logging.getLogger("torch.utils._pytree").warning(
    "<enum 'E'> is an Enum subclass and is now natively supported by torch.compile"
)
"""


def rank_lines(rank: int, level: str) -> list[str]:
    r = subprocess.run(
        [sys.executable, "-c", RANK, str(rank), level],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    # Drop the timestamp (two fields).
    return [line.split(" ", 2)[2] for line in r.stderr.splitlines()]


@pytest.mark.parametrize(
    "rank, level, expected",
    [
        (
            0,
            "info",
            [
                "neox.x: job info",
                "neox.x: own warning",
                "torchao: torchao says something else",
            ],
        ),
        (1, "info", ["rank 1 neox.x: own warning", "rank 1 torchao: torchao says something else"]),
        (
            1,
            "debug",
            [
                "rank 1 neox.x: job info",
                "rank 1 neox.x: neox debug",
                "rank 1 neox.x: own warning",
                "rank 1 torchao: Failed to load /x/_C_mxfp8.so: no CUDA",
                "rank 1 torchao: torchao says something else",
                "rank 1 torch.utils._pytree: <enum 'E'> is an Enum subclass and is now natively "
                "supported by torch.compile",
            ],
        ),
    ],
)
def test_each_rank_says_what_its_level_allows(rank, level, expected):
    assert rank_lines(rank, level) == expected


def test_library_deprecation_warnings_are_dropped_by_module_and_message():
    code = """
import warnings
from neox.console import quiet_libraries
quiet_libraries()
for module in ("transformers.modeling_utils", "mine"):
    warnings.warn_explicit(
        "`is_gradient_checkpointing` is deprecated", FutureWarning, f"{module}.py", 1, module
    )
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "mine.py:1: FutureWarning: `is_gradient_checkpointing` is deprecated"
