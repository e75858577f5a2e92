"""Parallel layout: tensor (model), pipeline and data parallelism."""

from typing import Literal

from neox.config.base import ConfigGroup, at_least, refuse_unless


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

    _tp_positive = at_least("model_parallel_size", least=1)
    _pp_nonnegative = at_least("pipe_parallel_size", least=0)
    _no_sequence_parallel = refuse_unless(
        "sequence_parallel",
        allowed=(False,),
        message="sequence_parallel is not implemented in neox; set it to false",
    )

    @property
    def pp(self) -> int:
        """Pipeline stages, with gpt-neox's 0 read as 1."""
        return max(1, self.pipe_parallel_size)
