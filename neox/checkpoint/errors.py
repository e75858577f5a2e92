"""The one error type of the checkpoint code (reading, resuming, converting)."""


class CheckpointError(ValueError):
    """A checkpoint path or its files cannot be used as asked; the message names the file, the
    reason and what to pass instead."""
