"""The tp x cp x pp x dp layout of ranks: validated before launch, process groups after.

Ranks are laid out as DeepSpeed's `PipeModelDataParallelTopology` lays them out, axes
(pipe, data, model) row-major, so tensor-parallel peers are adjacent ranks (same node) and
pipeline stages are furthest apart:  rank = (pipe * dp + data) * tp + model. Context-parallel
peers (cp > 1) sit between data and model, next after tensor-parallel ones as in Megatron (their
all-to-all in every layer wants the fast links):  rank = ((pipe * dp + data) * cp + context) *
tp + model.

`Topology` is plain arithmetic (only ProcessGroups uses torch.distributed); the rules a layout must
meet (world divisible by tp x pp, heads and MLP width by tp, layers by pp) are config checks in
neox/config/derived.py and neox/config/parallel.py, which `Topology.validate` applies.
`ProcessGroups` is the runtime side: the torch.distributed groups of one rank, and the `mpu`
object DeepSpeed's engine expects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from neox.config.derived import data_parallel_size
from neox.config.parallel import check_model_split

if TYPE_CHECKING:
    from neox.config.model import ModelConfig

logger = logging.getLogger(__name__)


class Coord(NamedTuple):
    """Where one rank sits: pipeline stage, data-parallel replica, tensor-parallel shard,
    sequence chunk."""

    pipe: int
    data: int
    model: int
    context: int = 0


@dataclass(frozen=True)
class Topology:
    """tp (model_parallel_size) x pp (pipe_parallel_size) x dp x cp (context_parallel_size)
    ranks; world = tp * pp * dp * cp."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology {name}={value!r} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> Topology:
        """dp = world_size / (tp * pp * cp); raises (ConfigError, a ValueError) when the ranks
        do not divide evenly (the rule lives with the config's other cross-field checks)."""
        return cls(tp=tp, pp=max(1, pp), dp=data_parallel_size(world_size, tp, pp, cp), cp=cp)

    @classmethod
    def validate(
        cls,
        model: ModelConfig,
        world_size: int,
        model_parallel_size: int = 1,
        pipe_parallel_size: int = 1,
        source: str = "",
    ) -> Topology:
        """Check a layout against the model before launch; returns the Topology or raises ValueError.

        Args:
            source: where the values came from (a config path), quoted in the messages.
        """
        topo = cls.from_world(world_size, model_parallel_size, pipe_parallel_size)
        topo.check_model(model, source)
        return topo

    def check_model(self, model: ModelConfig, source: str = "") -> None:
        """Raise ValueError, naming the key and the fix, when the model cannot be split this way."""
        check_model_split(model, self.tp, self.pp, source, self.cp)

    # ---- rank arithmetic (same layout as DeepSpeed's PipeModelDataParallelTopology) ----

    def coord(self, rank: int) -> Coord:
        """(pipe, data, model, context) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size} of {self}")
        model = rank % self.tp
        context = (rank // self.tp) % self.cp
        data = (rank // (self.tp * self.cp)) % self.dp
        pipe = rank // (self.tp * self.cp * self.dp)
        return Coord(pipe, data, model, context)

    def rank(self, pipe: int, data: int, model: int, context: int = 0) -> int:
        """Global rank at (pipe, data, model, context)."""
        return ((pipe * self.dp + data) * self.cp + context) * self.tp + model

    def _groups(self, vary: str) -> list[list[int]]:
        """The rank lists that differ only along the axes in `vary` (p, d, m, c), the other
        axes fixed, in row-major order of the fixed ones."""
        sizes = {"p": self.pp, "d": self.dp, "c": self.cp, "m": self.tp}
        fixed = [a for a in "pdcm" if a not in vary]
        out = []
        for f in product(*(range(sizes[a]) for a in fixed)):
            at = dict(zip(fixed, f))
            members = []
            for v in product(*(range(sizes[a]) for a in vary)):
                at.update(zip(vary, v))
                members.append(self.rank(at["p"], at["d"], at["m"], at["c"]))
            out.append(members)
        return out

    def tensor_group_ranks(self) -> list[list[int]]:
        """Ranks that share one layer's shards (same stage, replica and chunk)."""
        return self._groups("m")

    def data_group_ranks(self) -> list[list[int]]:
        """Ranks that hold the same weights and read different samples."""
        return self._groups("d")

    def context_group_ranks(self) -> list[list[int]]:
        """Ranks that share one sample, a chunk of its sequence each."""
        return self._groups("c")

    def gradient_group_ranks(self) -> list[list[int]]:
        """Ranks that hold the same weights and all-reduce gradients: data x context."""
        return self._groups("dc")

    def pipe_group_ranks(self) -> list[list[int]]:
        """Ranks that form one pipeline, stage 0 first."""
        return self._groups("p")

    def model_group_ranks(self) -> list[list[int]]:
        """Ranks that together hold one replica (pipe x tensor), DeepSpeed's 'model parallel'."""
        return self._groups("pm")

    def ds_topology(self) -> Any:
        """The equivalent deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology."""
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)

    def build_groups(self, rank: Optional[int] = None) -> ProcessGroups:
        """Create this layout's process groups (collective: every rank must call it)."""
        return ProcessGroups(self, rank)


class ProcessGroups:
    """One rank's tensor, data, context, pipeline and model process groups; DeepSpeed's `mpu`
    interface.

    Its `get_data_parallel_*` answer for the gradient group, data x context: context-parallel
    ranks hold the same weights, each with the gradients of its chunk of the tokens, so to an
    engine they are data-parallel ranks (DeepSpeed's Ulysses does the same with its
    sequence-data-parallel group). Which samples a rank reads is `coord.data` of `topo.dp`.

    'model parallel' follows DeepSpeed's meaning (all ranks of one replica, pipe x tensor), which
    is what its engine reduces gradient norms and overflow flags over; Megatron's meaning is the
    `tensor` group. Pass it explicitly: layers take `groups.tensor`, the engine takes the object.

    `sequence_parallel`: outside the tensor-parallel linears each tp rank holds 1/tp of the
    sequence (apply_tensor_parallel reads it; meaningless at tp 1, so it is off there).
    """

    def __init__(
        self, topo: Topology, rank: Optional[int] = None, sequence_parallel: bool = False
    ) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call deepspeed.init_distributed() "
                "(or torch.distributed.init_process_group) before building process groups"
            )
        world = dist.get_world_size()
        if world != topo.world_size:
            raise ValueError(
                f"world size {world} != model_parallel_size={topo.tp} x pipe_parallel_size="
                f"{topo.pp} x context_parallel_size={topo.cp} x data_parallel_size={topo.dp} "
                f"= {topo.world_size}"
            )
        self.topo = topo
        self.sequence_parallel = sequence_parallel and topo.tp > 1
        self.global_rank = dist.get_rank() if rank is None else rank
        self.coord = topo.coord(self.global_rank)

        def make(all_ranks: list[list[int]]) -> tuple[Any, list[int]]:
            # new_group is collective over the world: every rank creates every group, in order.
            mine = None
            for ranks in all_ranks:
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    mine = (group, ranks)
            assert mine is not None
            return mine

        self.tensor, self.tensor_ranks = make(topo.tensor_group_ranks())
        self.data, self.data_ranks = make(topo.data_group_ranks())
        self.pipe, self.pipe_ranks = make(topo.pipe_group_ranks())
        self.model, self.model_ranks = make(topo.model_group_ranks())
        # Without context parallelism both are the data group: no more groups to build.
        self.context, self.context_ranks = None, [self.global_rank]
        self.gradient, self.gradient_ranks = self.data, self.data_ranks
        if topo.cp > 1:
            self.context, self.context_ranks = make(topo.context_group_ranks())
            self.gradient, self.gradient_ranks = make(topo.gradient_group_ranks())
        logger.debug("rank %d: %s, groups built", self.global_rank, self.coord)

    def __repr__(self) -> str:
        return f"ProcessGroups({self.topo}, rank={self.global_rank}, {self.coord})"

    # Tensor (Megatron "model") parallel.
    def get_tensor_model_parallel_rank(self) -> int:
        return self.coord.model

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topo.tp

    def get_tensor_model_parallel_group(self) -> Any:
        return self.tensor

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tensor_ranks[0]

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    # Model parallel in DeepSpeed's sense: pipe x tensor.
    def get_model_parallel_rank(self) -> int:
        return self.model_ranks.index(self.global_rank)

    def get_model_parallel_world_size(self) -> int:
        return self.topo.tp * self.topo.pp

    def get_model_parallel_group(self) -> Any:
        return self.model

    # Data parallel, as engines see it: the gradient group (data x context).
    def get_data_parallel_rank(self) -> int:
        return self.gradient_ranks.index(self.global_rank)

    def get_data_parallel_world_size(self) -> int:
        return self.topo.dp * self.topo.cp

    def get_data_parallel_group(self) -> Any:
        return self.gradient

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.gradient_ranks)

    # Context parallel.
    def get_context_parallel_rank(self) -> int:
        return self.coord.context

    def get_context_parallel_world_size(self) -> int:
        return self.topo.cp

    def get_context_parallel_group(self) -> Any:
        return self.context

    # Pipeline parallel.
    def get_pipe_parallel_rank(self) -> int:
        return self.coord.pipe

    def get_pipe_parallel_world_size(self) -> int:
        return self.topo.pp

    def get_pipe_parallel_group(self) -> Any:
        return self.pipe

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group
