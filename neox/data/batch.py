"""Turn a batch of token windows into model inputs, labels, masks and positions (pure torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neox.kernels.flex_attention import DocumentMask


@dataclass
class Batch:
    """Model inputs for one micro-batch; every tensor is [B, T] unless noted."""

    tokens: torch.Tensor
    """Input ids: the window without its last token (int64)."""
    labels: torch.Tensor
    """Target ids: the window shifted left by one (int64)."""
    loss_mask: torch.Tensor
    """1.0 where the prediction counts toward the loss, 0.0 where it does not (float32)."""
    position_ids: torch.Tensor
    """Position of each input token; restarts at 0 after each EOD when reset_position_ids."""
    attention_mask: DocumentMask | None = None
    """The document of each token, for attention within one document (causal): attention
    kernels skip other documents' tiles, or take its dense [B, 1, T, T] bool mask
    (`attention_mask.dense()`); None unless reset_attention_mask, meaning plain causal."""
    document_ids: torch.Tensor | None = None
    """Document number of each input token within its row (EOD belongs to the document it ends);
    None unless reset_attention_mask."""


def document_ids(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """Number of EOD tokens strictly before each position, per row: 0 for the first document."""
    is_eod = (tokens == eod_token).long()
    # Exclusive cumulative sum: the EOD token itself still belongs to the document it closes.
    return torch.cumsum(is_eod, dim=1) - is_eod


def document_positions(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """Positions counted from the start of each document (the token after an EOD is position 0)."""
    B, T = tokens.shape
    index = torch.arange(T, device=tokens.device).expand(B, T)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eod_token
    # Each position's document start is the latest start at or before it.
    doc_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - doc_start


def build_batch(
    text: torch.Tensor,
    eod_token: int,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
) -> Batch:
    """Inputs, labels, masks and positions from windows `text` of shape [B, T + 1].

    Args:
        eod_mask_loss: no loss where the input is EOD (predicting across a document boundary).
        reset_position_ids: positions restart at each document, as gpt-neox's reset_position_ids.
        reset_attention_mask: tokens attend only within their own document.
    """
    if text.dim() != 2 or text.shape[1] < 2:
        raise ValueError(
            f"text must be [batch, seq_length + 1] with seq_length >= 1, got {tuple(text.shape)}"
        )
    text = text.long()
    tokens = text[:, :-1].contiguous()
    labels = text[:, 1:].contiguous()
    B, T = tokens.shape
    loss_mask = torch.ones((B, T), dtype=torch.float32, device=text.device)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    if reset_position_ids:
        position_ids = document_positions(tokens, eod_token)
    else:
        position_ids = torch.arange(T, device=text.device).expand(B, T).contiguous()
    attention_mask = doc_ids = None
    if reset_attention_mask:
        doc_ids = document_ids(tokens, eod_token)
        # No T x T mask here: only kernels that need one build it, from the ids.
        attention_mask = DocumentMask(doc_ids, T)
    return Batch(tokens, labels, loss_mask, position_ids, attention_mask, doc_ids)
