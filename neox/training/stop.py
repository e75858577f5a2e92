"""SIGTERM/SIGINT on a rank: finish the step in flight, save, exit; all ranks at the same step."""

import logging
import signal
import threading
from typing import Optional

from neox.parallel.agree import all_ranks_max

log = logging.getLogger(__name__)


class StopSignal:
    """Notes a stop signal on this rank; `agreed` tells every rank whether any rank got one.

    A cluster scheduler may signal some ranks and not others, or at different moments, so the
    ranks agree through one all-reduce of a single number per step (the cost of a scalar
    collective next to the loss's own). Repeated signals change nothing: the node's agent kills
    the ranks itself when deepy.py is asked twice, or when they overrun launcher.stop_grace_s.
    """

    def __init__(self) -> None:
        self.received: Optional[int] = None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            log.warning("%s received: stopping after this step", signal.Signals(signum).name)
            self.received = signum

    def agreed(self) -> Optional[int]:
        """The stop signal any rank received (the same answer on every rank), or None."""
        return all_ranks_max(self.received or 0) or None


def ignore_further_stops() -> None:
    """After the run has ended (saved or not), a late SIGTERM/SIGINT (an agent's, a
    scheduler's second) must not kill the rank while it leaves: Python restores the default,
    fatal, handlers during interpreter shutdown, but keeps an ignore."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
