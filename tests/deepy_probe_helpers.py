"""A per-rank script for deepy.py tests: decodes the handed-over config, all-reduces, reports.

Each rank writes <log_dir>/rank<R>.json with what it saw; `exit_interval` = a rank number
makes that rank fail at once, to test that deepy.py exits non-zero quickly.
"""

import json
import os
import sys
import time
from pathlib import Path

from neox.config import config_from_argv
from neox.launcher.rank_env import rank_env_from_launcher


def main() -> None:
    cfg = config_from_argv(sys.argv[1:])
    os.environ.update(rank_env_from_launcher(cfg.launcher, os.environ))  # mpirun, srun
    rank = int(os.environ["RANK"])
    if cfg.training.exit_interval is not None:
        if rank == cfg.training.exit_interval:
            raise SystemExit(f"rank {rank} fails on purpose")
        time.sleep(300)
    import torch

    from neox.parallel.distributed import start_deepspeed_comm

    start_deepspeed_comm("gloo")
    total = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(total)
    out = Path(cfg.logging.log_dir) / f"rank{rank}.json"
    out.write_text(
        json.dumps(
            {
                "rank": torch.distributed.get_rank(),
                "world_size": torch.distributed.get_world_size(),
                "sum": total.item(),
                "hidden_size": cfg.model.hidden_size,
                "save": cfg.checkpoint.save,
                "seed": cfg.training.seed,
                "node_rank": int(os.environ.get("CROSS_RANK", 0)),
                "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
                "wandb_group": cfg.logging.wandb_group,
                "hostile_env": os.environ.get("NEOX_HOSTILE"),
            }
        )
    )
    # Leave together: a process group torn down at interpreter exit can abort the process.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
