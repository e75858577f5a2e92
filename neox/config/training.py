"""The training loop: batch sizes, iterations, evaluation, memory savers."""

from typing import Optional

from pydantic import NonNegativeInt, PositiveInt

from neox.config.base import ConfigGroup, at_least, refuse_unless


class TrainingConfig(ConfigGroup):
    """How long to train, on what batch, and what to trade for memory."""

    train_micro_batch_size_per_gpu: Optional[PositiveInt] = None
    """Sequences per rank per forward pass (DeepSpeed key)."""

    gradient_accumulation_steps: Optional[PositiveInt] = None
    """Micro batches per optimizer step (DeepSpeed key)."""

    train_batch_size: Optional[PositiveInt] = None
    """Sequences per optimizer step over all data-parallel ranks (DeepSpeed key)."""

    batch_size: Optional[PositiveInt] = None
    """gpt-neox alias of train_micro_batch_size_per_gpu."""

    train_iters: int = 100
    """Optimizer steps to train for."""

    train_epochs: Optional[int] = None
    """gpt-neox key: train for this many epochs instead (not implemented: leave unset)."""

    seed: int = 1234
    """Seed of weights, data order and dropout."""

    eval_interval: PositiveInt = 1000
    """Evaluate on the validation set every N iterations."""

    eval_iters: NonNegativeInt = 10
    """Validation batches per evaluation."""

    max_nonfinite_steps: int = 10
    """Stop (saving nothing) after this many steps in a row whose loss or gradient is not finite;
    each such step is skipped and counted (0: never stop)."""

    exit_interval: Optional[PositiveInt] = None
    """Stop (after saving) once the iteration is a multiple of this."""

    do_train: bool = True
    """Run training; false only evaluates (do_valid, do_test) the loaded weights (gpt-neox key)."""

    do_valid: bool = True
    """Run validation (gpt-neox key)."""

    do_test: bool = True
    """Evaluate on the test set at the end (gpt-neox key)."""

    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this (0: off; DeepSpeed key)."""

    clip_grad: Optional[float] = None
    """gpt-neox alias of gradient_clipping."""

    torch_compile: Optional[bool] = None
    """Compile each transformer block, and the final norm, output layer and loss, with
    torch.compile (fewer, fused kernels; the first steps pay the compilation). Works with
    activation checkpointing, tensor and pipeline parallelism; parameter names and checkpoints
    are unchanged. Unset: on for GPU runs without tensor parallelism (20-30% faster at Pythia
    shapes on an H100, see docs/benchmarks.md), off on CPU, where compiling costs more than it
    saves in short runs, and with tensor parallelism."""

    flat_engine: bool = True
    """Without tensor or pipeline parallelism, in bf16 or fp32 with Adam/AdamW and ZeRO 0-1 (or 2
    on one rank) without offload, step with neox's own engine: parameters and gradients in flat
    buffers, one reduce-scatter, one AdamW pass and one all-gather per parameter group, no host
    sync. Same semantics as DeepSpeed's ZeRO-1 (fp32 master weights partitioned over the
    data-parallel ranks, clipping, skipped non-finite steps) and its checkpoint files, which it
    also resumes at another data-parallel size. false: DeepSpeed's engine always."""

    torch_compile_backend: str = "inductor"
    """torch.compile backend for torch_compile: inductor generates fused kernels; aot_eager
    traces the same graphs without generating code (quick, for debugging and CPU tests)."""

    checkpoint_activations: bool = False
    """Recompute activations in the backward pass to save memory."""

    checkpoint_num_layers: PositiveInt = 1
    """Blocks per activation checkpoint."""

    partition_activations: bool = False
    """Split checkpointed activations across tensor-parallel ranks (DeepSpeed)."""

    contiguous_checkpointing: bool = False
    """Copy checkpointed activations to a contiguous buffer (DeepSpeed)."""

    checkpoint_in_cpu: bool = False
    """Offload checkpointed activations to CPU (DeepSpeed)."""

    synchronize_each_layer: bool = False
    """Synchronize the device after each checkpointed layer (DeepSpeed)."""

    profile_backward: bool = False
    """Time the backward pass of checkpointed layers (DeepSpeed)."""

    deepspeed_activation_checkpointing: bool = True
    """Checkpoint through deepspeed.checkpointing (gpt-neox key); neox has no other
    implementation, so false is refused."""

    finetune: bool = False
    """Load weights only and restart the iteration count at 0."""

    char_level_ppl: bool = False
    """Character-level perplexity during training (gpt-neox key; not implemented: must be false;
    eval.py reports bits per byte)."""

    iteration: Optional[int] = None
    """Checkpoint generate.py and eval.py load from `load`: global_step<iteration> (None: the one
    `latest` names). Training ignores it."""

    z_loss: float = 0.0
    """gpt-neox key for the z-loss auxiliary term; not implemented in neox, so it must be 0."""

    _iters_nonnegative = at_least("train_iters", least=0)
    _steps_nonnegative = at_least("max_nonfinite_steps", least=0)
    _no_epochs = refuse_unless(
        "train_epochs",
        allowed=(None, 0),
        message="train_epochs is not implemented in neox; set train_iters instead",
    )
    _deepspeed_checkpointing = refuse_unless(
        "deepspeed_activation_checkpointing",
        allowed=(True,),
        message="activation checkpointing without DeepSpeed (torch.utils.checkpoint) is not "
        "implemented in neox; remove the key (DeepSpeed's checkpointing is used)",
    )
    _no_char_ppl = refuse_unless(
        "char_level_ppl",
        allowed=(False,),
        message="character-level perplexity is not implemented in neox; remove the key "
        "(eval.py reports bits per byte)",
    )
    _no_z_loss = refuse_unless(
        "z_loss",
        allowed=(0,),
        message="z_loss={value}: the z-loss auxiliary term is not implemented in neox; set it to 0",
    )
