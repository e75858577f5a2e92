"""One entry for the training loop: build the model for a layout, and the pieces DeepSpeed needs."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from neox.config.float8 import Float8Spec
from neox.config.model import ModelConfig
from neox.model import GPTNeoX, build_model, lm_loss
from neox.model.block import Block
from neox.model.rotary import RotaryEmbedding
from neox.model.transforms.float8 import apply_float8
from neox.parallel.activation_checkpointing import checkpoint_blocks, configure_checkpointing
from neox.parallel.context import apply_context_parallel
from neox.parallel.expert import apply_expert_parallel
from neox.parallel.pipeline import head_into_loss, to_pipeline
from neox.parallel.tensor import (
    apply_tensor_parallel,
    init_tensor_parallel,
    seed_parallel_rng,
    use_tensor_parallel_rng,
)
from neox.parallel.topology import ProcessGroups

logger = logging.getLogger(__name__)


def parallelize(
    model_cfg: ModelConfig,
    vocab_size: int,
    groups: ProcessGroups,
    seed: int = 1234,
    *,
    checkpoint_activations: bool = False,
    checkpoint_num_layers: int = 1,
    torch_compile: bool = False,
    torch_compile_backend: str = "inductor",
    activation_memory_budget: float = 1.0,
    partition_activations: bool = False,
    checkpointing_options: Optional[dict[str, Any]] = None,
    pipe_partition_method: str = "type:Block",
    device: Any = "cpu",
    float8: Optional[Float8Spec] = None,
    context_parallel_chunks: int = 1,
) -> nn.Module:
    """The GPTNeoX for this rank: plain with tp applied when pp = 1, else a PipelineModule.

    Seeds the RNG streams (seed_parallel_rng). `float8` (the resolved fp8 section) converts the
    chosen linears to float8 compute after tp. `context_parallel_chunks`: the head groups of
    context parallelism's exchange (neox/parallel/context.py). torch_compile compiles every block, keeping
    `activation_memory_budget` of each block's activations for backward. Weights equal the tp=1, pp=1 model's for the
    same seed, whatever the layout; no rank materialises more than its own shard.
    """
    groups.topo.check_model(model_cfg)
    if getattr(groups, "sequence_parallel", False):
        tp = groups.get_tensor_model_parallel_world_size()
        logger.info(
            "sequence parallel: %d of %d tokens per tensor-parallel rank between the linears",
            model_cfg.seq_length // tp,
            model_cfg.seq_length,
        )
    seed_parallel_rng(seed, groups)
    if checkpoint_activations:
        configure_checkpointing(groups, partition_activations, checkpointing_options)
    if groups.topo.pp > 1:
        pipe = to_pipeline(
            model_cfg,
            vocab_size,
            groups,
            seed,
            partition_method=pipe_partition_method,
            checkpoint_activations=checkpoint_activations,
            checkpoint_num_layers=checkpoint_num_layers,
            device=device,
        )
        if not torch_compile:
            return pipe
        return compile_blocks(pipe, torch_compile_backend, device, activation_memory_budget)
    model = build_model(model_cfg, vocab_size, seed, device="meta")
    apply_tensor_parallel(model, groups, model_cfg, copy_weights=False)
    init_tensor_parallel(model, model_cfg, seed, groups, device=device)
    apply_context_parallel(model, groups, context_parallel_chunks)
    if groups.get_tensor_model_parallel_world_size() > 1:
        use_tensor_parallel_rng(model)
    if model_cfg.moe_expert_parallel_size > 1:
        apply_expert_parallel(model, groups, model_cfg.moe_expert_parallel_size)
    apply_float8(model, float8, model_cfg.num_layers, device)
    if torch_compile:
        # Before checkpointing, which then recomputes through the compiled forward.
        # The grouped exchange's collectives overlap only where inductor keeps them apart.
        overlap = groups.get_context_parallel_world_size() > 1 and context_parallel_chunks > 1
        compile_blocks(
            model, torch_compile_backend, device, activation_memory_budget, overlap_comms=overlap
        )
    if checkpoint_activations:
        checkpoint_blocks(model.layers, checkpoint_num_layers)
    _register_head_weight(model)
    return model


def compile_blocks(
    model: nn.Module,
    backend: str = "inductor",
    device: Any = None,
    activation_memory_budget: float = 1.0,
    overlap_comms: bool = False,
) -> nn.Module:
    """torch.compile each Block's forward in place: one graph per block (the same code for every
    layer, so one compilation serves them all), names and state dict keys unchanged. Rotary
    tables are built on `device` first, so the graphs read them instead of recomputing them.
    The loss compiles with the output layer: the model's `loss`, or on a pipeline's last stage
    its loss_fn, into which head_into_loss moves the head.

    activation_memory_budget < 1: AOTAutograd's partitioner keeps that fraction of each graph's
    activations and recomputes the rest in backward, cheapest FLOPs per byte first. It is a
    process-wide torch setting, read when a graph first compiles (one model per process here).

    overlap_comms (context_parallel_chunks > 1): inductor's passes that start each collective as
    early and wait for it as late as its data allows, per block's compilation. Without them
    inductor kept the grouped exchange's forward order but, in the backward, waited for each
    gradient's exchange right after starting it (seen on CPU ranks, torch 2.13).
    """
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = activation_memory_budget
    blocks = sum(isinstance(m, Block) for m in model.modules())
    # Every block shares Block.forward's code object and so one dynamo cache. Where the blocks'
    # guards differ (under ZeRO-3 DeepSpeed's linear reads each weight's ds_id, a constant to
    # dynamo), each block needs its own entry, and past the recompile limit (8) the rest ran
    # eagerly: 16 of Pythia-1.4B's 24 blocks.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, blocks + 8)
    options = None
    if overlap_comms and backend == "inductor":
        options = {
            "reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms"],
        }
    for module in model.modules():
        if isinstance(module, Block):
            module.forward = torch.compile(module.forward, backend=backend, options=options)
        if isinstance(module, RotaryEmbedding) and device is not None:
            module.prepare(torch.device(device))
    # Final norm, output layer and cross-entropy as one graph: the fp32 cast, the softmax's
    # max, exp and sum and their gradient fuse instead of each passing over the (tokens x
    # vocab) logits, and no fp32 softmax is saved for backward. The vocab-parallel loss (tensor
    # parallelism) too: its collectives are traceable. On a pipeline's last stage this runs on
    # every micro batch's critical path. The chunked loss, its own autograd function, stays eager.
    if isinstance(model, GPTNeoX):
        if not (model.cfg.lm_loss_chunk_size and model.lm_loss is lm_loss):
            model.loss = torch.compile(model.loss, backend=backend)
        return model
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule) and head_into_loss(model):
        model.loss_fn = torch.compile(model.loss_fn, backend=backend)
    return model


def _register_head_weight(model: nn.Module) -> None:
    """Tell ZeRO-3 that the model's own forward reads the head weight (F.linear in `head`), which
    lives in embed_in/embed_out whose forward never runs for it; a no-op without ZeRO-3."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    owner = model.embed_in if model.embed_out is None else model.embed_out
    register_external_parameter(model, owner.weight)


def engine_mpu(model: nn.Module, groups: ProcessGroups) -> Optional[ProcessGroups]:
    """The mpu for deepspeed.initialize: None for a PipelineModule (it brings its own grid)."""
    from deepspeed.pipe import PipelineModule

    return None if isinstance(model, PipelineModule) else groups


def pipeline_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_weight: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One micro-batch as PipelineEngine.train_batch's iterator yields it: (inputs, labels);
    the last stage's loss_fn multiplies its masked mean by loss_weight when given (see
    neox.training.engine.weigh_micro_batches)."""
    if loss_weight is None:
        return input_ids, (labels, loss_mask)
    return input_ids, (labels, loss_mask, loss_weight)
