"""Where rank 0's progress goes: a tqdm bar on a terminal, plain lines in a file; W&B."""

import logging
import os
import sys

from neox.config import NeoXConfig
from neox.launcher.liveness import restart

log = logging.getLogger(__name__)


class Progress:
    """A progress bar when rank 0 writes to a terminal; log lines print above it."""

    def __init__(self, run, start: int) -> None:
        self.enabled = run.is_logging_rank
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            # A terminal that reports no size (a fresh `docker run -t`, some CI ptys) would get
            # no bar at all (tqdm reads 0 columns and -1 rows): give it a fixed size instead.
            sized = _columns(sys.stderr) > 0
            relaunch = restart()
            self.bar = tqdm(
                desc=None if relaunch is None else "restart {}/{}".format(*relaunch),
                total=run.cfg.training.train_iters,
                initial=start,
                unit="step",
                # One redraw per optimizer step (tens of microseconds): tqdm's default rate
                # limit would skip steps whose metrics arrive together (the loop reads them a
                # step late).
                mininterval=0,
                miniters=1,
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                nrows=None if sized else 24,
                file=sys.stderr,
            )

    def update(self, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
            self.bar.update(1)

    def log(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            log.info(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        return 0


def start_wandb(cfg: NeoXConfig):
    """A Weights & Biases run (WANDB_MODE=offline works without an account or network)."""
    try:
        import wandb
    except ImportError as e:
        raise RuntimeError(
            "use_wandb: true needs the wandb package: pip install 'neox[wandb]' (or set "
            "use_wandb: false)"
        ) from e
    lg = cfg.logging
    # A self-hosted W&B server; the run records it, so an offline run syncs to it later too.
    settings = wandb.Settings(base_url=lg.wandb_host) if lg.wandb_host else None
    return wandb.init(
        project=lg.wandb_project or "neox",
        name=lg.wandb_run_name,
        group=lg.wandb_group,
        entity=lg.wandb_team,
        config=cfg.to_flat(),
        dir=lg.log_dir,
        settings=settings,
    )
