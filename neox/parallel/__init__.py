"""Tensor, pipeline and data parallelism applied to the plain GPTNeoX from outside.

`neox.parallel.topology` imports neither torch nor DeepSpeed (config validation uses it before
launch); the rest is imported on first use.
"""

from neox.parallel.topology import Coord, ProcessGroups, Topology

__all__ = [
    "Coord",
    "ProcessGroups",
    "Topology",
    "apply_tensor_parallel",
    "engine_mpu",
    "parallelize",
    "pipeline_batch",
    "to_pipeline",
]

_LAZY = {
    "apply_tensor_parallel": "neox.parallel.tensor",
    "to_pipeline": "neox.parallel.pipeline",
    "parallelize": "neox.parallel.build",
    "engine_mpu": "neox.parallel.build",
    "pipeline_batch": "neox.parallel.build",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'neox.parallel' has no attribute {name!r}")
