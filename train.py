#!/usr/bin/env python
"""Per-rank training entry: started by deepy.py on every rank, or run directly as one rank.

python deepy.py train.py configs/tiny.yml      # through the launcher (any number of ranks)
python train.py configs/tiny.yml               # one process, no launcher
"""

import sys

from neox.checkpoint.consolidate import CheckpointError
from neox.config import ConfigError
from neox.entry import leave_together, peer_ended, rank_config
from neox.launcher.process import INPUT_ERROR_EXIT
from neox.training import run_training


def main(argv: list[str]) -> int:
    try:
        cfg = rank_config(argv)
    except ConfigError as e:
        print(f"train.py: config error:\n{e}", file=sys.stderr)
        return INPUT_ERROR_EXIT
    from neox.training.loop import NonFiniteSteps
    from neox.training.stop import ignore_further_stops

    try:
        run_training(cfg)
    except (CheckpointError, NonFiniteSteps) as e:
        # Every rank meets the same problem; one line each, no traceback. A relaunch would meet
        # it again: deepy.py's max_restarts never restarts this status.
        print(f"train.py: {e}", file=sys.stderr)
        return INPUT_ERROR_EXIT
    except RuntimeError as e:
        if not peer_ended(e):
            raise
        # Another rank stopped first (a full disk while it saved, say) and said why.
        print("train.py: stopped: another rank ended first (its output says why)", file=sys.stderr)
        return 1
    ignore_further_stops()  # the run is over: a late stop signal must not fail the exit
    leave_together()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
