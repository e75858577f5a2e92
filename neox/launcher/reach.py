"""Before a multi-node launch, log into every node the way the launch will, so a dead node fails
first."""

import logging
import subprocess
from concurrent.futures import ThreadPoolExecutor

from neox.launcher.hostfile import HostfileError
from neox.launcher.plan import LaunchPlan
from neox.launcher.ssh import CONNECT_TIMEOUT_S, ssh_argv

log = logging.getLogger(__name__)


def check_nodes_reachable(plan: LaunchPlan) -> None:
    """Raise HostfileError naming each node that ssh cannot log into (ssh and mpirun launches,
    see LaunchPlan.ssh_check), so that a node that is down is not found as ranks waiting for a
    peer until a collective times out."""
    if not plan.ssh_check:
        return

    def probe(host: str) -> str | None:
        cmd = ssh_argv(host, plan.ssh_port, plan.env) + ["true"]
        try:
            r = subprocess.run(
                cmd, env=plan.env, capture_output=True, text=True, timeout=CONNECT_TIMEOUT_S + 5
            )
        except subprocess.TimeoutExpired:
            return f"{host}: ssh did not answer within {CONNECT_TIMEOUT_S + 5} s"
        if r.returncode != 0:
            reason = (
                r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
            )
            return f"{host}: {reason}"
        return None

    with ThreadPoolExecutor(max_workers=min(32, len(plan.hosts))) as pool:
        failures = [f for f in pool.map(probe, plan.hosts) if f]
    if failures:
        port = f" -p {plan.ssh_port}" if plan.ssh_port else ""
        raise HostfileError(
            "cannot log into these nodes over ssh, so no rank was started:\n  "
            + "\n  ".join(failures)
            + f"\ncheck that `ssh{port} HOST true` works without a password (PDSH_SSH_ARGS_APPEND "
            "adds options), or remove the nodes from the hostfile (exclude=...)"
        )
    log.info("all %d nodes answer over ssh", len(plan.hosts))
