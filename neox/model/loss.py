"""Language-model loss: token cross-entropy averaged over the unmasked tokens, in float32.

Two ways to the same number: `lm_loss` from full logits, and `chunked_lm_loss` from the final
hidden states and the head weight, a chunk of tokens at a time, never holding (B, T, V) logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def masked_mean(losses: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean of per-token losses where loss_mask is nonzero (every token without a mask)."""
    losses = losses.flatten()
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.flatten().float()
    # clamp: a batch of only padding gives loss 0 instead of NaN.
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) against labels (B, T) where loss_mask is nonzero.

    labels are already the next tokens (the dataset shifts them), as in gpt-neox.
    """
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return masked_mean(losses, loss_mask)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss = masked mean over tokens of CE(h W^T, y), a chunk of rows of h at a time.

    The gradient is computed in the forward pass, chunk by chunk, while each chunk's logits are
    at hand (dz = (softmax(z) - onehot(y)) * weight): no logits are kept for backward and none
    are recomputed, so peak memory holds one chunk of (chunk, V) logits instead of (B*T, V).
    """

    @staticmethod
    def forward(ctx, h, weight, labels, token_weight, chunk_size):
        # h (N, C), weight (V, C), labels (N,), token_weight (N,) = mask / number of tokens.
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        dh = torch.empty_like(h) if need_grad else None
        dw = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
        for start in range(0, h.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            hc = h[rows]
            z = F.linear(hc, weight).float()  # (n, V)
            y, tw = labels[rows], token_weight[rows]
            lse = torch.logsumexp(z, dim=-1)
            loss += ((lse - z.gather(-1, y.unsqueeze(-1)).squeeze(-1)) * tw).sum()
            if need_grad:
                dz = torch.softmax(z, dim=-1)
                dz[torch.arange(dz.shape[0], device=dz.device), y] -= 1.0
                dz = (dz * tw.unsqueeze(-1)).to(h.dtype)
                dh[rows] = dz @ weight
                dw += (dz.t() @ hc).float()
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        return dh * grad.to(dh.dtype), (dw * grad).to(ctx.weight_dtype), None, None, None


def chunked_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: Optional[torch.Tensor] = None,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """lm_loss(F.linear(hidden, weight), labels, loss_mask) without the full logits.

    hidden (B, T, C) are the final-norm outputs, weight (V, C) the output layer; logits of
    `chunk_size` tokens at a time exist, in the weight's dtype for the product and float32 for
    the softmax, as lm_loss computes them.
    """
    labels = labels.flatten()
    if loss_mask is None:
        token_weight = torch.full(labels.shape, 1.0 / labels.numel(), device=hidden.device)
    else:
        mask = loss_mask.flatten().float()
        token_weight = mask / mask.sum().clamp(min=1.0)
    return _ChunkedLinearCrossEntropy.apply(
        hidden.flatten(0, 1), weight, labels, token_weight, chunk_size
    )
