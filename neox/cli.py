"""What the command-line tools in tools/ share: their parser, common flags and the error exit.

Library code raises; only tools/ use `exit_on`, which turns the errors a user can cause into
one line `tool: error: ...` and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from neox.console import quiet_libraries

CHECKPOINT_INPUT = "checkpoint directory (uses its `latest`) or one global_stepN directory"


def tool_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help is the tool's module docstring, line breaks kept."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)


def add_directories(p: argparse.ArgumentParser, input_help: str, output_help: str) -> None:
    """--input_dir, --output_dir (both required) and --overwrite."""
    p.add_argument("--input_dir", required=True, help=input_help)
    p.add_argument("--output_dir", required=True, help=output_help)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output_dir")


def add_iteration(p: argparse.ArgumentParser, verb: str) -> None:
    """--iteration N: the checkpoint's global_step<N> instead of its `latest`."""
    p.add_argument("--iteration", type=int, help=f"{verb} global_step<N> instead of `latest`")


@contextmanager
def exit_on(
    tool: str, *errors: type[Exception], what: str = "error", status: int = 1
) -> Iterator[None]:
    """Log at INFO to stderr, library notes that ask nothing dropped (neox/console.py); any of
    `errors` ends the tool with `tool: what: message` on stderr and exit status `status`."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet_libraries()
    try:
        yield
    except errors as err:
        message = f"{tool}: {what}: {err}"
        print(message, file=sys.stderr)
        stop = SystemExit(message)  # str() is the message, for callers that catch it
        stop.code = status  # an int: the interpreter exits with it and prints nothing more
        raise stop from None
