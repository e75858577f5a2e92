"""Parallel layout: tensor (model), pipeline and data parallelism."""

from typing import Literal

from pydantic import field_validator

from neox.config.base import ConfigGroup


class ParallelConfig(ConfigGroup):
    """How the model is split; data parallelism takes the remaining ranks."""

    model_parallel_size: int = 1
    """Tensor-parallel degree (Megatron-style column/row split of each layer)."""

    pipe_parallel_size: int = 1
    """Pipeline stages (gpt-neox: 0 and 1 both mean no pipeline)."""

    pipe_partition_method: str = "type:Block"
    """How layers are spread over stages: `type:Block`, `parameters` or `uniform` (DeepSpeed)."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism (not implemented: must stay false)."""

    distributed_backend: Literal["nccl", "gloo", "mpi"] = "nccl"
    """torch.distributed backend on GPUs; CPU ranks always use gloo."""

    @field_validator("model_parallel_size")
    @classmethod
    def _tp_positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"model_parallel_size={v} must be >= 1")
        return v

    @field_validator("pipe_parallel_size")
    @classmethod
    def _pp_nonnegative(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"pipe_parallel_size={v} must be >= 0")
        return v

    @field_validator("sequence_parallel")
    @classmethod
    def _no_sequence_parallel(cls, v: bool) -> bool:
        if v:
            raise ValueError("sequence_parallel is not implemented in neox; set it to false")
        return v

    @property
    def pp(self) -> int:
        """Pipeline stages, with gpt-neox's 0 read as 1."""
        return max(1, self.pipe_parallel_size)
