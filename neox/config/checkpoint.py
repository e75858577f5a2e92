"""Saving and loading checkpoints."""

from typing import Literal, Optional

from neox.config.base import ConfigGroup, at_least, refuse_unless


class CheckpointConfig(ConfigGroup):
    """Where checkpoints go, when they are written and what they hold."""

    save: Optional[str] = None
    """Directory checkpoints are saved to (None: never save)."""

    load: Optional[str] = None
    """Directory to resume from; one with no checkpoint starts from scratch (save = load is usual)."""

    checkpoint_factor: Optional[int] = None
    """Save every N iterations (linear scale) or at powers of N (log scale); gpt-neox's save-interval."""

    checkpoint_scale: Literal["linear", "log"] = "linear"
    """Spacing of checkpoints."""

    extra_save_iters: Optional[list[int]] = None
    """Iterations saved in addition to the regular ones."""

    keep_last_n_checkpoints: Optional[int] = None
    """Delete older checkpoints, keeping this many."""

    no_save_optim: bool = False
    """gpt-neox key: not implemented (DeepSpeed always writes the optimizer state), must be false."""

    no_save_rng: bool = False
    """Leave RNG state out of checkpoints."""

    no_load_optim: bool = False
    """Do not restore optimizer state."""

    no_load_rng: bool = False
    """Do not restore RNG state."""

    allow_tokenizer_mismatch: bool = False
    """Accept a tokenizer other than the one the checkpoint in `load` was trained with (another
    tokenizer_type, or vocab/merge files of other content). train.py, generate.py, eval.py and
    tools/convert_to_hf.py refuse one otherwise: its token ids would mean other text."""

    checkpoint_validation_with_forward_pass: bool = False
    """Check a loaded checkpoint with a forward pass (gpt-neox key; not implemented: must be
    false)."""

    save_iters: Optional[list[int]] = None
    """No-op (gpt-neox runtime key): save iterations follow checkpoint_factor/extra_save_iters."""

    _no_validation_pass = refuse_unless(
        "checkpoint_validation_with_forward_pass",
        allowed=(False,),
        message="checkpoint validation with a forward pass is not implemented in neox; set it "
        "false",
    )
    _factor_positive = at_least("checkpoint_factor", least=1, hint=" (or unset: save at the end)")
    _no_optimizerless_saves = refuse_unless(
        "no_save_optim",
        allowed=(False,),
        message="no_save_optim is not implemented: DeepSpeed writes the optimizer state into "
        "every checkpoint; leave it false (no_load_optim skips it when loading)",
    )
