"""SIGTERM and SIGINT to deepy.py: the first asks the ranks to save and stop, the second kills."""

import logging
import signal
import threading
from collections.abc import Callable
from typing import Optional

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class AbortLaunch(Exception):
    """A second stop signal: end every process of the launch now, without saving."""


class StopRequest:
    """Installs handlers for SIGTERM/SIGINT while the launch runs (main thread only).

    The first signal calls `forward` (which passes SIGTERM on to the ranks, so they finish the
    step in flight, save and exit); a second one raises AbortLaunch in the waiting loop.
    """

    def __init__(self, forward: Callable[[], None]) -> None:
        self.forward = forward
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            raise AbortLaunch(f"second stop signal ({name}): stopping every rank now, unsaved")
        self.signum = signum
        log.warning(
            "%s received: every rank finishes its step, saves a checkpoint and exits "
            "(send it again to stop at once, without saving)",
            name,
        )
        self.forward()

    @property
    def exit_code(self) -> int:
        """What deepy.py returns after a clean stop: 0 for SIGTERM, 130 for Ctrl-C."""
        return 130 if self.signum == signal.SIGINT else 0
