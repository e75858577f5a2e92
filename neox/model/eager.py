"""`eager_only`: torch.compiler.disable without importing the compiler at import time.

torch.compiler.disable imports torch._dynamo (2-4 s) where it decorates. Applied at the call
instead, and only when a compiled graph reaches the function, a process that compiles nothing
(generate.py's fused or eager decode) never pays that import before its first token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_only(fn: F) -> F:
    """fn, run eagerly (a graph break around it) when called from code torch.compile traces."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
