"""Parallel layout: tensor (model), pipeline and data parallelism."""

from typing import Annotated, Literal

from pydantic import Field, field_validator

from neox.config.base import MAX_RANKS, ConfigGroup, Reads, Refused


class ParallelConfig(ConfigGroup):
    """How the model is split; data parallelism takes the remaining ranks."""

    model_parallel_size: Annotated[int, Reads("neox/config/derived.py")] = Field(
        1, ge=1, le=MAX_RANKS
    )
    """Tensor-parallel degree (Megatron-style column/row split of each layer)."""

    pipe_parallel_size: Annotated[int, Reads("neox/config/parallel.py")] = Field(
        1, ge=0, le=MAX_RANKS
    )
    """Pipeline stages (gpt-neox: 0 and 1 both mean no pipeline)."""

    pipe_partition_method: Annotated[str, Reads("neox/training/setup.py")] = "type:Block"
    """How layers are spread over stages: `type:Block`, `parameters` or `uniform` (DeepSpeed)."""

    sequence_parallel: Annotated[
        bool,
        Refused(
            feature="sequence_parallel is not implemented",
            example=True,
            allowed=(False,),
            message=("sequence_parallel is not implemented in neox; set it to false"),
        ),
    ] = False
    """Megatron sequence parallelism (not implemented: must stay false)."""

    distributed_backend: Annotated[
        Literal["nccl", "gloo", "mpi"], Reads("neox/training/setup.py")
    ] = "nccl"
    """torch.distributed backend on GPUs; CPU ranks always use gloo."""

    @field_validator("pipe_partition_method")
    @classmethod
    def _partition_method(cls, v: str) -> str:
        # DeepSpeed's PipelineModule would refuse any other value on every rank after launch.
        if v not in ("parameters", "uniform") and not (v.startswith("type:") and len(v) > 5):
            raise ValueError(
                f"pipe_partition_method={v!r} is not a DeepSpeed partition method; use "
                "type:Block, parameters or uniform"
            )
        return v

    @property
    def pp(self) -> int:
        """Pipeline stages, with gpt-neox's 0 read as 1."""
        return max(1, self.pipe_parallel_size)
