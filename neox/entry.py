"""What every per-rank entry script (train.py, generate.py, eval.py) does first and last."""

from __future__ import annotations

import os

from neox.config import NeoXConfig, config_from_argv, load_config
from neox.console import configure_rank_logging
from neox.launcher.rank_env import rank_env_from_launcher


def rank_config(argv: list[str]) -> NeoXConfig:
    """The config deepy.py handed over (--neox_config), or config files named on the command
    line for a one-process run; ConfigError on a bad one. Logging is set up for this rank."""
    cfg = config_from_argv(argv) or load_config(a for a in argv if not a.startswith("-")).config
    env = {**os.environ, **rank_env_from_launcher(cfg.launcher, os.environ)}
    configure_rank_logging(int(env.get("RANK", 0)), cfg.logging.log_level)
    return cfg


def leave_together() -> None:
    """Barrier, then tear the process group down: one torn down at interpreter exit can abort
    the process."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# What gloo says in a collective whose peer process has ended.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def peer_ended(error: BaseException) -> bool:
    """A collective failed because another rank ended: that rank reports why (one line for a
    user's mistake), so this one adds no traceback of its own."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, RuntimeError) and any(s in str(error) for s in PEER_GONE):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False
