"""Parallel layout: tensor (model), pipeline and data parallelism."""

from typing import Annotated, Literal

from pydantic import Field, field_validator

from neox.config.base import MAX_RANKS, ConfigGroup, Reads, Refused
from neox.config.errors import ConfigError
from neox.config.model import ModelConfig


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
        Literal["nccl", "gloo", "mpi"], Reads("neox/parallel/distributed.py")
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


def check_model_split(m: ModelConfig, tp: int, pp: int, source: str = "") -> None:
    """Raise ConfigError, naming the key and the fix, when the model cannot be cut into `tp`
    tensor-parallel shards and `pp` pipeline stages.

    Args:
        source: where the values came from (a config path), quoted in the messages.
    """
    where = f" ({source})" if source else ""
    heads, pp = m.num_attention_heads, max(1, pp)
    if heads % tp:
        raise ConfigError(
            f"num_attention_heads={heads} is not divisible by model_parallel_size={tp}{where}; "
            f"use model_parallel_size {divisors(heads)}"
        )
    kv = m.shape.kv_heads
    if kv % tp:
        raise ConfigError(
            f"num_kv_heads={kv} is not divisible by model_parallel_size={tp}{where}; each "
            f"tensor-parallel rank needs whole key/value heads: use model_parallel_size "
            f"{divisors(kv)}, or raise num_kv_heads"
        )
    ffn = m.shape.ffn_size
    if ffn % tp:
        raise ConfigError(
            f"the MLP width {ffn} (intermediate_size/expansion_factor) is not divisible by "
            f"model_parallel_size={tp}{where}; use model_parallel_size {divisors(ffn)} or "
            f"set mlp_multiple_of to a multiple of {tp}"
        )
    if m.num_layers < pp:
        raise ConfigError(
            f"num_layers={m.num_layers} is smaller than pipe_parallel_size={pp}{where}; "
            f"every stage needs a block: use pipe_parallel_size <= {m.num_layers}"
        )


def divisors(n: int) -> str:
    """`1, 2, 4 or 8`: the divisors of n, for a message that names the choices."""
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else ds[0]
