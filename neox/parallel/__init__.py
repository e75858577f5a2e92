"""Tensor, pipeline and data parallelism applied to the plain GPTNeoX from outside.

`topology` is the layout (tp x pp x dp) and its process groups; `tensor` swaps the model's
linears for column/row-parallel ones; `pipeline` cuts it into DeepSpeed pipeline stages;
`build.parallelize` does all of it for a run. DeepSpeed is imported inside the functions that
need it, so importing this package costs torch, not DeepSpeed.
"""

from neox.parallel.build import engine_mpu, parallelize, pipeline_batch
from neox.parallel.pipeline import to_pipeline
from neox.parallel.tensor import apply_tensor_parallel
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
