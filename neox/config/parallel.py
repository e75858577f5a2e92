"""Parallel layout: tensor (model), pipeline, context and data parallelism."""

from typing import Annotated, Literal

from pydantic import Field, field_validator

from neox.config.base import MAX_RANKS, ConfigGroup, Reads, Restricted
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

    context_parallel_size: Annotated[
        int, Reads("neox/config/derived.py", "neox/parallel/context.py")
    ] = Field(1, ge=1, le=MAX_RANKS)
    """Context-parallel degree (Megatron's name): each sample's sequence is split over this many
    ranks, which attend over the whole sequence through an all-to-all of heads (Ulysses,
    neox/parallel/context.py). Data parallelism gets world / (tp x pp x cp) ranks. Needs
    (num_attention_heads / model_parallel_size) and seq_length divisible by it; key/value heads
    that do not divide are replicated. Not with pipe_parallel_size > 1 or train_impl other than
    normal (refused by name)."""

    context_parallel_chunks: Annotated[
        int, Reads("neox/config/parallel.py", "neox/training/setup.py", "deepy.py")
    ] = Field(1, ge=1, le=MAX_RANKS)
    """Head groups of context parallelism's exchange (issue 38; opt-in until measured on 4
    GPUs). At 1 one all-to-all carries a layer's q, k and v and one its output, both exposed.
    At G > 1 each rank's heads are cut into G groups whose all-to-alls are started and waited
    for apart: every group's q, k, v leave before the first group's kernel, and a group's
    output leaves while the next group's kernel runs (backward the same in reverse; compiled
    blocks get inductor's comm-reordering passes). Needs (num_attention_heads /
    model_parallel_size / context_parallel_size) divisible by it; read only at
    context_parallel_size > 1, so a config that sets it for its CP layouts runs on one GPU too."""

    sequence_parallel: Annotated[
        bool,
        Reads("neox/config/parallel.py"),
        Restricted(
            "With model_parallel_size > 1, needs seq_length divisible by it, and is not with "
            "context_parallel_size > 1, MoE (moe_num_experts > 1), LoRA (lora_rank > 0) or "
            "train_impl other than normal.",
            example={"sequence_parallel": True, "model_parallel_size": 2},
            broken_by=(
                {"seq_length": 2047},
                {"moe_num_experts": 2},
                {"lora_rank": 8},
                {
                    "train_impl": "dpo",
                    "pos_train_data_paths": ["p"],
                    "neg_train_data_paths": ["n"],
                    "do_valid": False,
                    "do_test": False,
                },
            ),
        ),
    ] = False
    """Megatron's sequence parallelism: under tensor parallelism the layers between the
    tensor-parallel linears (norms, residual adds, dropout, the embedding's output) hold
    seq_length / model_parallel_size tokens on each tensor-parallel rank instead of all of them,
    which divides their activation memory by model_parallel_size; all-reduces become an
    all-gather before the column-parallel linears and a reduce-scatter after the row-parallel
    ones (the same bytes). Training only (train.py, with or without pipeline parallelism, any
    ZeRO stage); generation and evaluation load the same weights without it. It turns
    partition_activations off: a checkpointed block input already is this rank's 1/tp of the
    sequence (the memory that key would save), and DeepSpeed's partitioning assumes the tp ranks
    hold the same input. Off at model_parallel_size 1, as in Megatron (one rank's chunk would be
    the whole sequence), so a config that sets it for its tensor-parallel layouts also runs on
    one GPU. A memory lever, not a speed one: at Pythia-1.4B, TP=2 on two H200s of one node, it
    trained at 49.9k tokens/s against 60-70k for TP alone in the same day's other calls
    (docs/parallelism.md)."""

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

    def check_with(
        self,
        train_impl: str,
        model: ModelConfig,
        lora_rank: int = 0,
    ) -> None:
        """context_parallel_size against the objective, its chunks against the heads,
        sequence_parallel against the model and the other features (run when a NeoXConfig is
        validated)."""
        cp = self.context_parallel_size
        if cp > 1 and train_impl != "normal":
            raise ValueError(
                f"context_parallel_size={cp} with train_impl={train_impl!r} is not supported: its "
                "loss reads whole sequences' log-probabilities on one rank; use "
                "context_parallel_size 1"
            )
        if cp > 1:
            self._check_context_chunks(model)
        if self.splits_sequence:
            self._check_sequence_parallel(train_impl, model, lora_rank)

    def _check_context_chunks(self, model: ModelConfig) -> None:
        """context_parallel_chunks: whole heads in every group of a rank's share."""
        chunks, heads = self.context_parallel_chunks, model.num_attention_heads
        tp, cp = self.model_parallel_size, self.context_parallel_size
        if chunks == 1 or heads % (tp * cp):
            return  # nothing to cut, or check_model_split names the layout's own problem
        per_rank = heads // tp // cp
        if per_rank % chunks:
            raise ValueError(
                f"context_parallel_chunks={chunks} does not divide the {per_rank} heads each rank "
                f"attends with (num_attention_heads={heads} / model_parallel_size={tp} / "
                f"context_parallel_size={cp}); each group needs whole heads: use "
                f"context_parallel_chunks {divisors(per_rank)}"
            )

    def _check_sequence_parallel(self, train_impl: str, model: ModelConfig, lora_rank: int) -> None:
        tp, T = self.model_parallel_size, model.seq_length
        what = f"sequence_parallel: true with model_parallel_size={tp}"
        if T % tp:
            raise ValueError(
                f"{what} needs seq_length divisible by it (each tensor-parallel rank holds an "
                f"equal chunk), got seq_length={T}; use a seq_length that is a multiple of {tp}"
            )
        cp, experts = self.context_parallel_size, model.moe_num_experts
        refusals = [
            (cp > 1, f"context_parallel_size={cp} (both split the sequence: use one of them)"),
            (experts > 1, f"moe_num_experts={experts} (its token routing is not sharded)"),
            (lora_rank > 0, f"lora_rank={lora_rank} (its adapters' linears are not sharded)"),
            (
                train_impl != "normal",
                f"train_impl={train_impl!r} (its losses read whole sequences)",
            ),
        ]
        for refused, reason in refusals:
            if refused:
                raise ValueError(
                    f"{what} is not supported with {reason}; set sequence_parallel to false"
                )

    @property
    def splits_sequence(self) -> bool:
        """sequence_parallel in effect: asked for, and tensor parallelism to split over."""
        return self.sequence_parallel and self.model_parallel_size > 1

    @property
    def pp(self) -> int:
        """Pipeline stages, with gpt-neox's 0 read as 1."""
        return max(1, self.pipe_parallel_size)


def check_model_split(m: ModelConfig, tp: int, pp: int, source: str = "", cp: int = 1) -> None:
    """Raise ConfigError, naming the key and the fix, when the model cannot be cut into `tp`
    tensor-parallel shards, `pp` pipeline stages and `cp` sequence chunks.

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
    if cp > 1:
        check_context_split(m, tp, pp, cp, where)


def check_context_split(m: ModelConfig, tp: int, pp: int, cp: int, where: str) -> None:
    """context_parallel_size's rules: whole heads and whole sequence chunks per rank (Ulysses
    scatters the heads of each tensor-parallel rank over the context-parallel ranks)."""
    heads = m.num_attention_heads // tp
    if heads % cp:
        raise ConfigError(
            f"num_attention_heads / model_parallel_size = {heads} is not divisible by "
            f"context_parallel_size={cp}{where}; context parallelism gives each rank whole "
            f"heads of the full sequence: use context_parallel_size {divisors(heads)}"
        )
    if m.seq_length % cp:
        raise ConfigError(
            f"seq_length={m.seq_length} is not divisible by context_parallel_size={cp}{where}; "
            f"each rank takes an equal chunk of every sequence: use context_parallel_size "
            f"{divisors(m.seq_length)} or a seq_length that is a multiple of {cp}"
        )
    if pp > 1:
        raise ConfigError(
            f"context_parallel_size={cp} with pipe_parallel_size={pp}{where} is not supported "
            "yet (the pipeline's stages pass tokens only, not the positions and documents of a "
            "chunk); use pipe_parallel_size 1, or context_parallel_size 1"
        )


def divisors(n: int) -> str:
    """`1, 2, 4 or 8`: the divisors of n, for a message that names the choices."""
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else ds[0]
