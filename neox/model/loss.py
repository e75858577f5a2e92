"""Language-model loss: token cross-entropy averaged over the unmasked tokens, in float32."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) against labels (B, T) where loss_mask is nonzero.

    labels are already the next tokens (the dataset shifts them), as in gpt-neox.
    """
    losses = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), reduction="none"
    )  # (B*T,)
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.flatten().float()
    # clamp: a batch of only padding gives loss 0 instead of NaN.
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
