"""The training loop: batch sizes, iterations, evaluation, memory savers."""

from typing import Annotated, Optional

from pydantic import Field, model_validator

from neox.config.base import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_LAYERS,
    ConfigGroup,
    Reads,
    Refused,
    Restricted,
)


class TrainingConfig(ConfigGroup):
    """How long to train, on what batch, and what to trade for memory."""

    train_micro_batch_size_per_gpu: Annotated[Optional[int], Reads("neox/config/derived.py")] = (
        Field(None, gt=0, le=MAX_BATCH)
    )
    """Sequences per rank per forward pass (DeepSpeed key)."""

    gradient_accumulation_steps: Annotated[Optional[int], Reads("neox/config/derived.py")] = Field(
        None, gt=0, le=MAX_BATCH
    )
    """Micro batches per optimizer step (DeepSpeed key)."""

    train_batch_size: Annotated[Optional[int], Reads("neox/config/derived.py")] = Field(
        None, gt=0, le=MAX_BATCH
    )
    """Sequences per optimizer step over all data-parallel ranks (DeepSpeed key)."""

    batch_size: Annotated[Optional[int], Reads("neox/config/derived.py")] = Field(
        None, gt=0, le=MAX_BATCH
    )
    """gpt-neox alias of train_micro_batch_size_per_gpu."""

    train_iters: Annotated[int, Reads("neox/training/loop.py", "neox/config/derived.py")] = Field(
        100, ge=0, le=MAX_COUNT
    )
    """Optimizer steps to train for."""

    train_epochs: Annotated[
        Optional[int],
        Refused(
            feature="train_epochs is not implemented",
            example=2,
            allowed=(None, 0),
            message=("train_epochs is not implemented in neox; set train_iters instead"),
        ),
    ] = None
    """gpt-neox key: train for this many epochs instead (not implemented: leave unset)."""

    seed: Annotated[int, Reads("neox/training/setup.py")] = Field(1234, ge=0, le=2**32 - 1)
    """Seed of weights, data order and dropout."""

    eval_interval: Annotated[int, Reads("neox/training/loop.py")] = Field(1000, ge=1, le=MAX_COUNT)
    """Evaluate on the validation set every N iterations."""

    eval_iters: Annotated[int, Reads("neox/training/loop.py")] = Field(10, ge=0, le=MAX_COUNT)
    """Validation batches per evaluation."""

    max_nonfinite_steps: Annotated[int, Reads("neox/training/loop.py")] = Field(
        10, ge=0, le=MAX_COUNT
    )
    """Stop (saving nothing) after this many steps in a row whose loss or gradient is not finite;
    each such step is skipped and counted (0: never stop)."""

    exit_interval: Annotated[Optional[int], Reads("neox/training/loop.py")] = Field(
        None, ge=1, le=MAX_COUNT
    )
    """Stop (after saving) once the iteration is a multiple of this."""

    do_train: Annotated[bool, Reads("neox/training/loop.py")] = True
    """Run training; false only evaluates (do_valid, do_test) the loaded weights (gpt-neox key)."""

    do_valid: Annotated[bool, Reads("neox/training/loop.py")] = True
    """Run validation (gpt-neox key)."""

    do_test: Annotated[bool, Reads("neox/training/loop.py")] = True
    """Evaluate on the test set at the end (gpt-neox key)."""

    gradient_clipping: Annotated[float, Reads("neox/config/ds_config.py")] = Field(1.0, ge=0)
    """Clip the global gradient norm to this (0: off; DeepSpeed key)."""

    clip_grad: Annotated[Optional[float], Reads("neox/config/ds_config.py")] = Field(None, ge=0)
    """gpt-neox alias of gradient_clipping."""

    torch_compile: Annotated[
        Optional[bool],
        Reads("neox/training/setup.py", "neox/plan/memory.py", "neox/inference/modes.py"),
    ] = None
    """Compile each transformer block, and the final norm, output layer and loss, with
    torch.compile (fewer, fused kernels; the first steps pay the compilation). Works with
    activation checkpointing, tensor and pipeline parallelism; parameter names and checkpoints
    are unchanged. Unset: on for GPU runs (20-30% faster at Pythia shapes on an H100, 1.39x
    at TP=2 on two H200, see docs/benchmarks.md), off on CPU, where compiling costs more than
    it saves in short runs. generate.py: when true (not when unset), on a GPU without tensor
    parallelism the whole cached decode step is compiled, then captured as one CUDA graph:
    1.9x the tokens/s of the captured eager step at Pythia-410M on an H100, but each new batch
    shape and cache length compiles once (30-40 s), so it pays for long generation jobs, not
    for a few prompts."""

    flat_engine: Annotated[bool, Reads("neox/plan/engine_choice.py")] = True
    """Without tensor or pipeline parallelism, in bf16 or fp32 with Adam/AdamW and ZeRO 0-1 (or 2
    on one rank) without offload, step with neox's own engine: parameters and gradients in flat
    buffers, one reduce-scatter, one AdamW pass and one all-gather per parameter group, no host
    sync. Same semantics as DeepSpeed's ZeRO-1 (fp32 master weights partitioned over the
    data-parallel ranks, clipping, skipped non-finite steps) and its checkpoint files, which it
    also resumes at another data-parallel size. false: DeepSpeed's engine always."""

    torch_compile_backend: Annotated[str, Reads("neox/training/setup.py")] = "inductor"
    """torch.compile backend for torch_compile: inductor generates fused kernels; aot_eager
    traces the same graphs without generating code (quick, for debugging and CPU tests)."""

    checkpoint_activations: Annotated[bool, Reads("neox/training/setup.py")] = False
    """Recompute activations in the backward pass to save memory."""

    activation_memory_budget: Annotated[
        float,
        Reads("neox/parallel/build.py", "neox/plan/memory.py"),
        Restricted(
            "Below 1, needs torch_compile (not false) and checkpoint_activations: false.",
            example={"activation_memory_budget": 0.5},
            broken_by=({"torch_compile": False}, {"checkpoint_activations": True}),
        ),
    ] = Field(1.0, ge=0, le=1)
    """Selective activation checkpointing inside each compiled block (torch_compile): the
    fraction of its activations, between recomputing all (0) and the default partition (1),
    that forward keeps for backward. Below 1, torch.compile's partitioner recomputes what costs
    fewest FLOPs per byte saved (pointwise ops first), so at long sequences, where attention
    costs the most per byte it saves, it reruns far less than checkpoint_activations, which
    reruns every block whole (1.28x its tokens/s at seq 32k, docs/benchmarks.md). 1: off."""

    checkpoint_num_layers: Annotated[
        int, Reads("neox/training/setup.py", "neox/config/ds_config.py")
    ] = Field(1, ge=1, le=MAX_LAYERS)
    """Blocks per activation checkpoint."""

    partition_activations: Annotated[bool, Reads("neox/config/ds_config.py")] = False
    """Split checkpointed activations across tensor-parallel ranks (DeepSpeed)."""

    contiguous_checkpointing: Annotated[bool, Reads("neox/config/ds_config.py")] = False
    """Copy checkpointed activations to a contiguous buffer (DeepSpeed)."""

    checkpoint_in_cpu: Annotated[bool, Reads("neox/config/ds_config.py")] = False
    """Offload checkpointed activations to CPU (DeepSpeed)."""

    synchronize_each_layer: Annotated[bool, Reads("neox/config/ds_config.py")] = False
    """Synchronize the device after each checkpointed layer (DeepSpeed)."""

    profile_backward: Annotated[bool, Reads("neox/config/ds_config.py")] = False
    """Time the backward pass of checkpointed layers (DeepSpeed)."""

    deepspeed_activation_checkpointing: Annotated[
        bool,
        Refused(
            feature="without DeepSpeed",
            example=False,
            allowed=(True,),
            message=(
                "activation checkpointing without DeepSpeed (torch.utils.checkpoint) is not "
                "implemented in neox; remove the key (DeepSpeed's checkpointing is used)"
            ),
        ),
    ] = True
    """Checkpoint through deepspeed.checkpointing (gpt-neox key); neox has no other
    implementation, so false is refused."""

    finetune: Annotated[bool, Reads("neox/checkpoint/io.py")] = False
    """Load weights only and restart the iteration count at 0."""

    char_level_ppl: Annotated[
        bool,
        Refused(
            feature="character-level perplexity",
            example=True,
            allowed=(False,),
            message=(
                "character-level perplexity is not implemented in neox; remove the key (eval.py "
                "reports bits per byte)"
            ),
        ),
    ] = False
    """Character-level perplexity during training (gpt-neox key; not implemented: must be false;
    eval.py reports bits per byte)."""

    iteration: Annotated[
        Optional[int], Reads("neox/inference/loading.py", "neox/inference/evaluation.py")
    ] = Field(None, ge=0, le=MAX_COUNT)
    """Checkpoint generate.py and eval.py load from `load`: global_step<iteration> (None: the one
    `latest` names). Training ignores it."""

    z_loss: Annotated[
        float,
        Refused(
            feature="z-loss auxiliary term is not implemented",
            example=0.1,
            allowed=(0,),
            message=(
                "z_loss={value}: the z-loss auxiliary term is not implemented in neox; set it to 0"
            ),
        ),
    ] = 0.0
    """gpt-neox key for the z-loss auxiliary term; not implemented in neox, so it must be 0."""

    @model_validator(mode="after")
    def _selective_recompute(self) -> "TrainingConfig":
        # A budget below 1 selects what compiled blocks recompute.
        budget = self.activation_memory_budget
        if budget < 1 and self.torch_compile is False:
            raise ValueError(
                f"activation_memory_budget={budget} selects what compiled blocks "
                "recompute, but torch_compile is false; unset torch_compile (on for GPU runs) or "
                "use checkpoint_activations: true"
            )
        if budget < 1 and self.checkpoint_activations:
            raise ValueError(
                f"activation_memory_budget={budget} and checkpoint_activations: "
                "true both recompute activations (the whole block would be rerun, then part of it "
                "again); set checkpoint_activations: false to recompute selectively, or "
                "activation_memory_budget: 1 to rerun whole blocks"
            )
        return self
