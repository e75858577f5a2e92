"""The plain GPTNeoX as a DeepSpeed PipelineModule: embedding, blocks, final norm, head.

Each stage is made of the model's own classes (Block, the embedding and norm modules of
GPTNeoX), built on the meta device, tensor-parallel-sharded, and only then materialised and
initialised from init_parameter under its plain-model name ("layers.3.mlp.dense_h_to_4h.weight"),
so a rank allocates only its own stage's shard and every layout starts from the same weights.
Activations passed between stages are hidden states (B, T, C); position ids are the default
0..T-1 and there is no padding mask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from neox.config.model import ModelConfig
from neox.model.block import Block
from neox.model.gpt import GPTNeoX
from neox.model.norms import build_norm
from neox.parallel.sequence_linear import sequence_parallel_linear
from neox.parallel.tensor import (
    apply_tensor_parallel,
    init_tensor_parallel,
    lm_loss_parallel,
    use_tensor_parallel_rng,
)
from neox.parallel.topology import ProcessGroups

logger = logging.getLogger(__name__)

PARTITION_METHODS = ("type:Block", "parameters", "uniform")


def _finish(
    module: nn.Module,
    cfg: ModelConfig,
    groups: ProcessGroups,
    seed: int,
    prefix: str,
    device: Any,
) -> None:
    """Shard a meta-built piece over tp, then materialise it with its init_parameter values."""
    apply_tensor_parallel(module, groups, cfg, copy_weights=False)
    init_tensor_parallel(module, cfg, seed, groups, prefix=prefix, device=device)
    if groups.get_tensor_model_parallel_world_size() > 1:
        use_tensor_parallel_rng(module)


class EmbeddingPipe(nn.Module):
    """First stage: input_ids (B, T) -> embed_in(ids) [+ embed_pos(positions)], dropout.

    Also the tied output head on the last stage (with_positions=False): logits = h E^T.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        groups: ProcessGroups,
        seed: int,
        device: Any = "cpu",
        with_positions: bool = True,
    ) -> None:
        super().__init__()
        with torch.device("meta"):
            shell = GPTNeoX(cfg, vocab_size)  # meta: costs nothing, just the same submodules
        self.cfg = cfg
        self.embed_in = shell.embed_in
        self.embed_pos = shell.embed_pos if with_positions else None
        self.emb_dropout = shell.emb_dropout
        _finish(self, cfg, groups, seed, "", device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return GPTNeoX.embed(self, input_ids)


def tied_head(module: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """logits shard = hidden @ (this rank's vocab rows of embed_in)^T."""
    group = getattr(module.embed_in, "group", None)
    return sequence_parallel_linear(hidden, module.embed_in.weight, group=group)


class PipeBlock(Block):
    """One transformer block of the pipeline, the model's Block sharded and initialised by name."""

    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        layer_type: str,
        groups: ProcessGroups,
        seed: int,
        device: Any = "cpu",
    ) -> None:
        with torch.device("meta"):
            super().__init__(cfg, layer_type)
        _finish(self, cfg, groups, seed, f"layers.{index}.", device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class FinalNormPipe(nn.Module):
    """Last stage: final_layer_norm (its output enters the vocab-split head on every tp rank)."""

    def __init__(self, cfg: ModelConfig, groups: ProcessGroups, seed: int, device: Any = "cpu"):
        super().__init__()
        with torch.device("meta"):
            self.final_layer_norm = build_norm(cfg)
        _finish(self, cfg, groups, seed, "", device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layer_norm(x)


class OutputPipe(nn.Module):
    """Untied head: logits (shard) = h W_out^T, W_out split by vocab rows (column-parallel)."""

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        groups: ProcessGroups,
        seed: int,
        device: Any = "cpu",
    ) -> None:
        super().__init__()
        with torch.device("meta"):
            self.embed_out = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        _finish(self, cfg, groups, seed, "", device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = getattr(self.embed_out, "group", None)
        return sequence_parallel_linear(x, self.embed_out.weight, group=group)


def pipeline_loss_fn(groups: ProcessGroups) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """loss_fn(logits, (labels, loss_mask[, loss_weight])) for the last stage: masked
    vocab-parallel CE, times the micro-batch's loss_weight when given."""
    group = groups.tensor

    def loss_fn(logits: torch.Tensor, labels: Any) -> torch.Tensor:
        parts = tuple(labels) if isinstance(labels, (tuple, list)) else (labels,)
        target, mask, weight = (*parts, None, None)[:3]
        loss = lm_loss_parallel(logits, target, mask, group)
        return loss if weight is None else loss * weight

    return loss_fn


def head_into_loss(pipe: nn.Module) -> bool:
    """On the last stage, move the head out of the layers into loss_fn: the stage's forward ends
    at the final norm and loss_fn(hidden, labels) runs the output layer and the loss, one
    function that torch.compile traces as one graph (compile_blocks). The same loss and
    gradients; only the stage's own output changes (hidden states, not logits). False, and
    nothing changed, on the other stages."""
    if pipe.stage_id != pipe.num_stages - 1:
        return False
    head, loss_of_logits = pipe.forward_funcs[-1], pipe.loss_fn
    if isinstance(head, nn.Module):
        # OutputPipe stays among the layers: DeepSpeed saves and loads the weights of the
        # modules there (a function in its place would drop the head from checkpoints).
        logits_of = head.forward
        head.forward = _final_hidden
    else:  # the tied head, partial(tied_head, module): its weight is saved with the embedding
        logits_of = head
        pipe.forward_funcs[-1] = _final_hidden

    def loss_fn(hidden: torch.Tensor, labels: Any) -> torch.Tensor:
        return loss_of_logits(logits_of(hidden), labels)

    pipe.loss_fn = loss_fn
    return True


def _final_hidden(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _pipeline_class() -> type:
    from deepspeed.pipe import LayerSpec, PipelineModule

    class GPTNeoXPipe(PipelineModule):
        """PipelineModule whose 'parameters' partitioning counts on meta, building nothing."""

        def _count_layer_params(self) -> list[int]:
            # DeepSpeed builds every layer on every rank to count them; ours build real weights,
            # so count the same modules constructed on the meta device instead.
            counts = []
            for spec in self._layer_specs:
                if isinstance(spec, LayerSpec):
                    counts.append(getattr(spec, "num_params", 0))
                else:
                    counts.append(sum(p.numel() for p in spec.parameters() if p.requires_grad))
            return counts

    return GPTNeoXPipe


def to_pipeline(
    cfg: ModelConfig,
    vocab_size: int,
    groups: ProcessGroups,
    seed: int = 1234,
    *,
    partition_method: str = "type:Block",
    checkpoint_activations: bool = False,
    checkpoint_num_layers: int = 1,
    device: Any = "cpu",
    loss_fn: Optional[Callable[..., torch.Tensor]] = None,
) -> nn.Module:
    """A deepspeed.pipe.PipelineModule of the GPTNeoX for `cfg`, stages over groups.topo.pp.

    Layers: embedding (tied to the head through TiedLayerSpec when weights are tied), one
    PipeBlock per layer, final norm, head. Only this rank's stage is built.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    if partition_method not in PARTITION_METHODS and not partition_method.startswith("type:"):
        raise ValueError(
            f"pipe_partition_method={partition_method!r} is not supported; use one of "
            f"{', '.join(PARTITION_METHODS)} (or type:<ClassRegex>)"
        )
    with torch.device("meta"):
        shell = GPTNeoX(cfg, vocab_size)
    tied = shell.embed_out is None
    tp = groups.get_tensor_model_parallel_world_size()

    def counted(spec: LayerSpec, *modules: Optional[nn.Module]) -> LayerSpec:
        # Per-rank count; read by GPTNeoXPipe for partition_method="parameters".
        n = sum(p.numel() for m in modules if m is not None for p in m.parameters())
        spec.num_params = n // tp
        return spec

    args = (cfg, vocab_size, groups, seed)
    specs: list[Any] = []
    if tied:
        embed = TiedLayerSpec(
            "embed", EmbeddingPipe, *args, device=device, tied_weight_attr="embed_in.weight"
        )
    else:
        embed = LayerSpec(EmbeddingPipe, *args, device=device)
    specs.append(counted(embed, shell.embed_in, shell.embed_pos))
    for i, (block, kind) in enumerate(zip(shell.layers, cfg.shape.layer_types)):
        specs.append(
            counted(LayerSpec(PipeBlock, cfg, i, kind, groups, seed, device=device), block)
        )
    specs.append(
        counted(LayerSpec(FinalNormPipe, cfg, groups, seed, device=device), shell.final_layer_norm)
    )
    if tied:
        head = TiedLayerSpec(
            "embed",
            EmbeddingPipe,
            *args,
            device=device,
            with_positions=False,
            forward_fn=tied_head,
            tied_weight_attr="embed_in.weight",
        )
        specs.append(counted(head, shell.embed_in))
    else:
        specs.append(counted(LayerSpec(OutputPipe, *args, device=device), shell.embed_out))

    cls = _pipeline_class()
    return cls(
        layers=specs,
        topology=groups.topo.ds_topology(),
        loss_fn=loss_fn if loss_fn is not None else pipeline_loss_fn(groups),
        partition_method=partition_method,
        activation_checkpoint_interval=checkpoint_num_layers if checkpoint_activations else 0,
        # Only blocks: a reentrant checkpoint of the embedding (integer input) gets no gradient.
        checkpointable_layers=["PipeBlock"],
    )
