"""Each config key's status (read, no-op or refused), as its field declares it.

A key declares its status where it is defined (see neox/config/base.py): a `Reads(...)` or
`Refused(...)` mark in its annotation, or a docstring that starts with "No-op".
tests/config/test_registry.py checks every declaration against the code, and docs/config.md
shows it. A new key needs no row anywhere else.
"""

from typing import Optional

from neox.config.base import NoOp, Reads, Refused, Status, status_of
from neox.config.schema import GROUPS

__all__ = ["KEYS", "NoOp", "Reads", "Refused", "Status"]


def _statuses() -> dict[str, Optional[Status]]:
    return {
        key: status_of(field) for cls in GROUPS.values() for key, field in cls.model_fields.items()
    }


# Flat key -> its declared status (None: the field declares none, which the test refuses).
KEYS: dict[str, Optional[Status]] = _statuses()
