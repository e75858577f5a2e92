"""Training: the loop, optimizer and LR schedule, metrics."""

from neox.training.loop import evaluate, run_training, train, train_step

__all__ = ["evaluate", "run_training", "train", "train_step"]
