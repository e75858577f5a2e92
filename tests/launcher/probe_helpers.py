"""A per-rank entry script for launch tests: joins the job, all-reduces its rank, writes what it saw.

Usage: probe_helpers.py --out DIR [--neox_config B64] [--echo TEXT] [--die_rank R] [--after_init]
Each rank writes DIR/rank<R>.json. With --die_rank R, rank R raises at once (or, with
--after_init, after joining) while every other rank sleeps until it is stopped.
"""

import argparse
import base64
import json
import os
import socket
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--neox_config", default=None)
    parser.add_argument("--echo", default=None)
    parser.add_argument("--die_rank", type=int, default=None)
    parser.add_argument("--after_init", action="store_true")
    parser.add_argument("--local_rank", type=int, default=None)  # added by DeepSpeed's launch.py
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    dying = args.die_rank == rank
    if dying and not args.after_init:
        raise RuntimeError(f"probe rank {rank} fails on purpose")
    if args.die_rank is not None and not dying and not args.after_init:
        time.sleep(600)  # blocks until the launcher stops it

    import deepspeed
    import torch

    from neox.parallel.distributed import start_deepspeed_comm

    start_deepspeed_comm("gloo")
    if args.die_rank is not None:
        if dying:
            raise RuntimeError(f"probe rank {rank} fails on purpose after init")
        time.sleep(600)
    total = torch.tensor([rank])
    deepspeed.comm.all_reduce(total)
    result = {
        "rank": rank,
        "world_size": int(os.environ["WORLD_SIZE"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "arg_local_rank": args.local_rank,
        "node_rank": int(os.environ["CROSS_RANK"]),
        "comm_rank": deepspeed.comm.get_rank(),
        "comm_world_size": deepspeed.comm.get_world_size(),
        "all_reduce": int(total.item()),
        "host": socket.gethostname(),
        "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
        "export_probe": os.environ.get("NEOX_TEST_EXPORT"),
        "echo": args.echo,
        "config": (
            json.loads(base64.urlsafe_b64decode(args.neox_config)) if args.neox_config else None
        ),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    deepspeed.comm.barrier()
    # Leave together: a gloo group torn down at interpreter exit can abort a rank (SIGABRT).
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
