"""Automatic restart (`max_restarts`): relaunch a failed training run from its newest checkpoint.

One decision at the top, in deepy.py, covers every node and launcher: launch() has already
ended every rank on every node when it returns a failure, and says whether a relaunch may get
past it (a rank that died or hung, a node lost; not a stop signal, not a rank's exit 2 for an
error that would recur). The relaunch is the same command with a fresh launch id (and, on one
node, a fresh port), `load` pointed at `save` once it holds a checkpoint, and NEOX_RESTART=k/N
in every rank's environment (the metrics' `restarts`, the progress bar's "restart k/N").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Optional

from neox.checkpoint.compat import latest_state
from neox.config import NeoXConfig
from neox.launcher.hostfile import LaunchError
from neox.launcher.liveness import RESTART_ENV
from neox.launcher.plan import LaunchPlan
from neox.launcher.run import LaunchResult, launch

log = logging.getLogger(__name__)

RESTARTED_SCRIPT = "train.py"


def restart_problem(cfg: NeoXConfig, script: str) -> Optional[str]:
    """Why `max_restarts` cannot work for this launch, or None."""
    n = cfg.launcher.max_restarts
    if n and os.path.basename(script) == RESTARTED_SCRIPT and cfg.checkpoint.save is None:
        return (
            f"max_restarts={n} needs `save`: a restart resumes from the newest checkpoint "
            "there; set save (and checkpoint_factor), or max_restarts: 0"
        )
    return None


def resume_config(cfg: NeoXConfig) -> NeoXConfig:
    """The config of a relaunch: it resumes this run's own newest checkpoint once `save` holds
    one (as its own run, so not `finetune`), else it starts as the first launch did."""
    save = cfg.checkpoint.save
    if latest_state(save) is None or (cfg.checkpoint.load == save and not cfg.training.finetune):
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.checkpoint.load = save
    cfg.training.finetune = False
    return cfg


def launch_with_restarts(
    cfg: NeoXConfig,
    script: str,
    plan_for: Callable[[NeoXConfig, dict[str, str]], LaunchPlan],
    first: LaunchPlan,
    config_at: Optional[str] = None,
    on_stop: Optional[Callable[[], None]] = None,
) -> LaunchResult:
    """Launch `first`; after a failure a relaunch may get past, relaunch up to max_restarts
    times with plan_for(config, environment), each restart logged with its cause. A relaunch
    plan_for refuses (LaunchError: a node that no longer answers ssh) ends the run there."""
    most = cfg.launcher.max_restarts if os.path.basename(script) == RESTARTED_SCRIPT else 0
    result = launch(first, config_at, on_stop)
    for k in range(1, most + 1):
        if not result.retry:
            return result
        relaunch = resume_config(cfg)
        where = _resumes_from(relaunch)
        log.warning("restart %d/%d after: %s; it %s", k, most, _first_line(result.failure), where)
        environ = {**os.environ, RESTART_ENV: f"{k}/{most}"}
        try:
            plan = plan_for(relaunch, environ)
        except LaunchError as e:
            log.error(
                "restart %d/%d not launched: %s\nonce that is fixed (a node back, or out of the "
                "hostfile), the same command %s",
                k,
                most,
                e,
                where,
            )
            return result
        result = launch(plan, config_at, on_stop)
    if most and result.retry:
        log.error(
            "giving up: the run failed %d time(s), the limit max_restarts=%d reached; the last "
            "failure: %s; once it is fixed, the same command %s",
            most + 1,
            most,
            _first_line(result.failure),
            _resumes_from(resume_config(cfg)),
        )
    return result


def _resumes_from(cfg: NeoXConfig) -> str:
    state = latest_state(cfg.checkpoint.save)
    if state is None:
        return "starts over: no checkpoint saved yet"
    return f"resumes from {cfg.checkpoint.save}/{state[0]}"


def _first_line(text: Optional[str]) -> str:
    return (text or "a node ended without a report").splitlines()[0]
