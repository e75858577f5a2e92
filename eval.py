#!/usr/bin/env python
"""Per-rank evaluation entry: perplexity / bits per byte, LAMBADA and lm-evaluation-harness tasks
of the checkpoint in `load`; results go to <log_dir>/<eval_results_prefix>_eval_results_*.json.

python deepy.py eval.py configs/tiny.yml eval.yml   # through the launcher (any number of ranks)
python eval.py configs/tiny.yml eval.yml            # one process, no launcher
"""

import json
import sys

from neox.config import ConfigError
from neox.entry import leave_together, rank_config
from neox.prep.readers import InputError


def main(argv: list[str]) -> int:
    try:
        cfg = rank_config(argv)
    except ConfigError as e:
        print(f"eval.py: config error:\n{e}", file=sys.stderr)
        return 2
    from neox.checkpoint.consolidate import CheckpointError
    from neox.inference.evaluation import run_evaluation
    from neox.inference.loading import check_checkpoint_tokenizer

    try:
        check_checkpoint_tokenizer(cfg)
        written = run_evaluation(cfg)
    except (ConfigError, InputError, CheckpointError) as e:
        print(f"eval.py: error:\n{e}", file=sys.stderr)
        return 2
    if written:
        path, results = written
        print(json.dumps(results, indent=2))
        print(f"eval results written to {path}")
    leave_together()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
