"""Saving and loading checkpoints."""

from typing import Annotated, Literal, Optional

from pydantic import Field

from neox.config.base import MAX_COUNT, ConfigGroup, Reads, Refused

# tools/convert_to_hf.py's --architecture names (neox/hf/mapping.py ARCH_NAMES).
HF_FAMILIES = ("neox", "llama", "mistral", "qwen2", "qwen3")
HF_FAMILIES += ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")  # mixtures of experts

# Iteration 0 is the initial weights (Pythia ships step0).
Iteration = Annotated[int, Field(ge=0, le=MAX_COUNT)]


class CheckpointConfig(ConfigGroup):
    """Where checkpoints go, when they are written and what they hold."""

    save: Annotated[Optional[str], Reads("neox/checkpoint/io.py")] = None
    """Directory checkpoints are saved to (None: never save)."""

    load: Annotated[Optional[str], Reads("neox/checkpoint/io.py", "neox/plan/preflight.py")] = None
    """Directory to resume from; one with no checkpoint starts from scratch (save = load is usual)."""

    checkpoint_factor: Annotated[Optional[int], Reads("neox/checkpoint/io.py")] = Field(
        None, ge=1, le=MAX_COUNT
    )
    """Save every N iterations (linear scale) or at powers of N (log scale); gpt-neox's save-interval."""

    checkpoint_scale: Annotated[Literal["linear", "log"], Reads("neox/checkpoint/io.py")] = "linear"
    """Spacing of checkpoints."""

    extra_save_iters: Annotated[Optional[list[Iteration]], Reads("neox/checkpoint/io.py")] = None
    """Iterations saved in addition to the regular ones."""

    keep_last_n_checkpoints: Annotated[Optional[int], Reads("neox/checkpoint/io.py")] = Field(
        None, ge=1, le=MAX_COUNT
    )
    """Delete older checkpoints, keeping this many."""

    no_save_optim: Annotated[
        bool,
        Refused(
            feature="no_save_optim is not implemented",
            example=True,
            allowed=(False,),
            message=(
                "no_save_optim is not implemented: neox writes the optimizer state into "
                "every checkpoint; leave it false (no_load_optim skips it when loading)"
            ),
        ),
    ] = False
    """gpt-neox key: not implemented (neox always writes the optimizer state), must be false."""

    async_save: Annotated[bool, Reads("neox/checkpoint/io.py", "neox/plan/memory.py")] = False
    """Save in the background: the step waits only for the copy of the training state to host
    memory (counted in the estimate), a thread writes it and publishes it atomically when complete.
    The checkpoint is the synchronous save's, file for file (docs/checkpoints.md)."""

    no_save_rng: Annotated[bool, Reads("neox/checkpoint/io.py")] = False
    """Leave RNG state out of checkpoints."""

    no_load_optim: Annotated[bool, Reads("neox/checkpoint/io.py")] = False
    """Do not restore optimizer state."""

    no_load_rng: Annotated[bool, Reads("neox/checkpoint/io.py")] = False
    """Do not restore RNG state."""

    allow_tokenizer_mismatch: Annotated[bool, Reads("neox/checkpoint/compat.py")] = False
    """Accept a tokenizer other than the one the checkpoint in `load` was trained with (another
    tokenizer_type, or vocab/merge files of other content). train.py, generate.py, eval.py and
    tools/convert_to_hf.py refuse one otherwise: its token ids would mean other text."""

    trust_checkpoint_code: Annotated[
        bool, Reads("neox/checkpoint/io.py", "neox/inference/loading.py")
    ] = False
    """Load checkpoint files with full unpickling, which runs any code a file holds. Off: only
    tensors and the few classes neox's and DeepSpeed's own files hold are rebuilt, and a file
    needing more is refused. Set it only for a checkpoint you trust (e.g. written by other code
    with extra client state)."""

    allow_unverified_checkpoint: Annotated[
        bool,
        Reads(
            "neox/checkpoint/io.py",
            "neox/checkpoint/compat.py",
            "neox/inference/loading.py",
            "neox/inference/evaluation.py",
            "neox/adapters/load_base.py",
            "neox/checkpoint/relayout.py",
        ),
    ] = False
    """Read a checkpoint neox wrote whose manifest.json is gone, its files unchecked against
    their checksums (tools: --allow-unverified). Off: such a checkpoint is refused (resume
    falls back to an older one), since a lost manifest also hides corrupt files. Checkpoints of
    gpt-neox or DeepSpeed have no manifest; they load either way, with a warning."""

    checkpoint_validation_with_forward_pass: Annotated[
        bool,
        Refused(
            feature="checkpoint validation",
            example=True,
            allowed=(False,),
            message=(
                "checkpoint validation with a forward pass is not implemented in neox; set it false"
            ),
        ),
    ] = False
    """Check a loaded checkpoint with a forward pass (gpt-neox key; not implemented: must be
    false)."""

    hf_architecture: Annotated[
        Optional[Literal[HF_FAMILIES]],
        Reads("neox/hf/export.py"),
    ] = None
    """The Hugging Face family the weights were imported from (tools/convert_from_hf.py sets
    it); tools/convert_to_hf.py exports as this family unless --architecture says otherwise
    (None: `neox`, GPTNeoXForCausalLM)."""

    hf_files: Annotated[Optional[str], Reads("neox/hf/tokenizer_files.py")] = None
    """Directory of the Hugging Face files carried over by tools/convert_from_hf.py (tokenizer
    files, generation_config.json, chat template, the original config.json);
    tools/convert_to_hf.py writes them back beside the weights when the run still uses that
    tokenizer. Relative paths are read from the current directory, like vocab_file."""

    hf_source: Annotated[Optional[str], Reads("neox/hf/export.py")] = None
    """The Hugging Face model the weights were imported from: its hub name when
    tools/convert_from_hf.py read a hub cache snapshot, else the directory's absolute path.
    A `--lora_format peft` export of the same family names it as the adapter's
    base_model_name_or_path, so the adapter loads on the original base."""

    save_iters: Optional[list[Iteration]] = None
    """No-op (gpt-neox runtime key): save iterations follow checkpoint_factor/extra_save_iters."""
