"""Hostfiles (`host slots=N`) and DeepSpeed's include/exclude syntax, resolved to the active slots."""

import re
from pathlib import Path
from typing import Optional

HOSTFILE_FORM = "`<host> slots=<N>` (N >= 1), optionally followed by `# comment`"

_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)\s*(#.*)?$")
# Hosts end up in ssh's, mpirun's and srun's argv and in remote shell commands, so only plain
# host names pass (an optional user@); a leading '-' would make the name an option.
_HOST = re.compile(r"^[A-Za-z0-9_.@-]+$")
_OPTION_LIKE = re.compile(r"(^|@)-")


class LaunchError(ValueError):
    """A launcher setting or environment that cannot be planned; the message says the fix."""


class HostfileError(LaunchError):
    """A hostfile, include/exclude or node count that cannot be resolved; the message says the fix."""


def parse_hostfile(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile text into {host: slots}, in file order."""
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        match = _LINE.match(line)
        if match is None:
            raise HostfileError(f"{where}: cannot read {line!r}; expected {HOSTFILE_FORM}")
        host, slots = match["host"], int(match["slots"])
        if not _HOST.match(host):
            raise HostfileError(
                f"{where}: host {host!r} has characters other than letters, digits, '.', '-', "
                "'_' and '@'; write the plain host name or IP address"
            )
        if _OPTION_LIKE.search(host):
            raise HostfileError(
                f"{where}: host {host!r} starts with '-', which ssh and mpirun would read as an "
                "option; write the plain host name or IP address"
            )
        if slots < 1:
            raise HostfileError(f"{where}: {host} has slots={slots}; expected {HOSTFILE_FORM}")
        if host in pool:
            raise HostfileError(
                f"{where}: host {host} is listed again (first on line {first_line[host]}); "
                "keep one line per host and put all its slots there"
            )
        pool[host] = slots
        first_line[host] = number
    if not pool:
        raise HostfileError(f"{source}: no hosts found; expected lines of the form {HOSTFILE_FORM}")
    return pool


def read_hostfile(path: str) -> dict[str, int]:
    """Read and parse the hostfile at `path`."""
    file = Path(path)
    if not file.is_file():
        raise HostfileError(
            f"hostfile {path} does not exist; point launcher.hostfile at a file of {HOSTFILE_FORM} "
            "lines, or leave it unset to run on this machine only"
        )
    return parse_hostfile(file.read_text(), source=str(path))


def parse_node_spec(spec: str, option: str = "include") -> dict[str, list[int]]:
    """Parse DeepSpeed's `host1:0,1@host2` into {host: sorted slots}; [] means every slot."""
    nodes: dict[str, list[int]] = {}
    for part in spec.split("@"):
        host, sep, slot_text = part.partition(":")
        if not host or (sep and not slot_text):
            raise HostfileError(
                f"{option}={spec!r}: empty entry {part!r}; write NAME or NAME:SLOT[,SLOT...] "
                "joined by '@', e.g. 'worker-0@worker-1:0,2'"
            )
        slots: list[int] = []
        for item in slot_text.split(",") if sep else []:
            if not item.strip().isdigit():
                raise HostfileError(
                    f"{option}={spec!r}: slot {item!r} of host {host} is not a slot number; "
                    "slots are 0-based integers, e.g. 'worker-1:0,2'"
                )
            slots.append(int(item))
        nodes[host] = sorted(set(nodes.get(host, []) + slots))
    return nodes


def select_resources(
    pool: dict[str, int],
    include: Optional[str] = None,
    exclude: Optional[str] = None,
    num_nodes: int = -1,
    num_gpus: Optional[int] = None,
    source: str = "hostfile",
) -> dict[str, list[int]]:
    """Resolve the pool and the filters into {host: slot ids} as DeepSpeed's runner does."""
    if include and exclude:
        raise HostfileError(
            f"include={include!r} and exclude={exclude!r} are both set; DeepSpeed takes one "
            "or the other, so keep only one"
        )
    if (include or exclude) and (num_nodes != -1 or num_gpus is not None):
        raise HostfileError(
            f"num_nodes={num_nodes} / num_gpus={num_gpus} cannot be combined with "
            f"{'include' if include else 'exclude'}; DeepSpeed refuses both at once, so name "
            "the slots in the filter instead"
        )
    active = {host: list(range(slots)) for host, slots in pool.items()}
    if include or exclude:
        option, spec = ("include", include) if include else ("exclude", exclude)
        chosen = parse_node_spec(spec, option)
        for host, slots in chosen.items():
            if host not in pool:
                raise HostfileError(
                    f"{option}={spec!r} names host {host!r}, which is not in {source} "
                    f"(hosts: {', '.join(pool)})"
                )
            missing = [s for s in slots if s >= pool[host]]
            if missing:
                raise HostfileError(
                    f"{option}={spec!r} names slot {missing[0]} of {host}, which has "
                    f"slots=0..{pool[host] - 1} in {source}"
                )
        if include:
            active = {h: (chosen[h] or active[h]) for h in active if h in chosen}
        else:
            active = {
                h: [s for s in slots if h not in chosen or (chosen[h] and s not in chosen[h])]
                for h, slots in active.items()
            }
            active = {h: slots for h, slots in active.items() if slots}
        if not active:
            raise HostfileError(f"{option}={spec!r} leaves no slots to run on in {source}")
    if num_nodes != -1:
        if num_nodes > len(active):
            raise HostfileError(
                f"num_nodes={num_nodes} but {source} has {len(active)} host(s); "
                "lower num_nodes or add hosts"
            )
        active = dict(list(active.items())[:num_nodes])
    if num_gpus is not None:
        short = {h: len(s) for h, s in active.items() if len(s) < num_gpus}
        if short:
            host, slots = next(iter(short.items()))
            raise HostfileError(
                f"num_gpus={num_gpus} but {host} has slots={slots} in {source}; "
                f"lower num_gpus to {min(short.values())} or raise the host's slots"
            )
        active = {h: list(range(num_gpus)) for h in active}
    return active
