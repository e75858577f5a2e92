#!/usr/bin/env python
"""Per-rank generation entry: started by deepy.py on every rank, or run directly as one rank.

python deepy.py generate.py configs/tiny.yml gen.yml   # through the launcher (tp ranks)
python generate.py configs/tiny.yml gen.yml            # one process, no launcher
"""

import sys

from neox.config import ConfigError
from neox.entry import leave_together, rank_config


def main(argv: list[str]) -> int:
    try:
        cfg = rank_config(argv)
        from neox.inference.loading import check_checkpoint_tokenizer
        from neox.inference.modes import run_generation

        check_checkpoint_tokenizer(cfg)
        run_generation(cfg)
    except ConfigError as e:
        print(f"generate.py: config error:\n{e}", file=sys.stderr)
        return 2
    leave_together()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
