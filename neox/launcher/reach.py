"""Before a multi-node launch, log into every node the way pdsh will, so a dead node fails first."""

import logging
import shlex
import subprocess
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from neox.launcher.hostfile import HostfileError
from neox.launcher.plan import LaunchPlan

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10


def ssh_command(host: str, port: int | None, env: Mapping[str, str]) -> list[str]:
    """`ssh ... host true` with the options pdsh's ssh module will use for this launch."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
    if port is not None:
        cmd += ["-p", str(port)]
    cmd += shlex.split(env.get("PDSH_SSH_ARGS_APPEND", ""))
    return cmd + [host, "true"]


def check_nodes_reachable(plan: LaunchPlan) -> None:
    """Raise HostfileError naming each node that ssh cannot log into (pdsh launches only).

    DeepSpeed's runner checks only the first host, and with plain ssh options, so a node that is
    down would otherwise surface as ranks waiting for a peer until a collective times out.
    """
    if plan.launcher != "pdsh":
        return

    def probe(host: str) -> str | None:
        cmd = ssh_command(host, plan.ssh_port, plan.env)
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
