"""Learning-rate schedule: linear warmup, then constant, linear, cosine or exponential decay."""

import math
from dataclasses import dataclass


@dataclass
class LRSchedule:
    """lr(step) for the optimizer; a pure function of the step, so resuming needs only the step."""

    peak_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str = "cosine"

    def lr(self, step: int) -> float:
        if self.warmup_iters > 0 and step < self.warmup_iters:
            # Start at peak/warmup rather than 0 so step 0 already updates the weights.
            return self.peak_lr * (step + 1) / self.warmup_iters
        if self.style == "constant":
            return self.peak_lr
        span = max(1, self.decay_iters - self.warmup_iters)
        progress = min(1.0, max(0.0, (step - self.warmup_iters) / span))
        if self.style == "linear":
            factor = 1.0 - progress
        elif self.style == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        elif self.style == "exponential":
            # Decays to min_lr at decay_iters (gpt-neox: peak * 0.1 ** progress, floored).
            factor = 0.1**progress
        else:
            raise ValueError(f"unknown lr_decay_style {self.style!r}")
        return max(self.min_lr, self.min_lr + (self.peak_lr - self.min_lr) * factor)

    def apply(self, optimizer, step: int) -> float:
        """Set the learning rate of every param group for this step; returns it."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr
