"""Turn a batch of token windows into model inputs, labels, masks and positions (pure torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from neox.data.indexed import IGNORE_INDEX  # noqa: F401  (the label value of "not trained")


@dataclass
class Batch:
    """Model inputs for one micro-batch; every tensor is [B, T] unless noted."""

    tokens: torch.Tensor
    """Input ids: the window without its last token (int64)."""
    labels: torch.Tensor
    """Target ids: the window shifted left by one (int64); with a label window, its values
    shifted so, masked positions holding 0 (any valid id: their loss is multiplied by 0)."""
    loss_mask: torch.Tensor
    """1.0 where the prediction counts toward the loss, 0.0 where it does not (float32): 0 where
    the label window holds -100, and at EOD inputs with eod_mask_loss."""
    position_ids: torch.Tensor
    """Position of each input token; restarts at 0 after each EOD when reset_position_ids."""
    document_ids: torch.Tensor | None = None
    """Document number of each input token within its row (EOD belongs to the document it ends);
    None unless reset_attention_mask."""
    loss_weight: torch.Tensor | None = None
    """0-d float32: what this micro-batch's masked-mean loss is multiplied by so that the step's
    loss is the mean over the trained tokens of the whole global batch (set by
    neox.training.engine.weigh_micro_batches; None: the plain per-micro-batch mean)."""

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """[B, 1, T, T] bool, True where query i may attend to key j (causal and within one
        document); None unless reset_attention_mask, meaning plain causal attention. Built on
        each read, never stored: an engine holds a whole step's micro-batches at once."""
        if self.document_ids is None:
            return None
        return document_attention_mask(self.document_ids)

    @property
    def trained_tokens(self) -> torch.Tensor:
        """Sum of the loss mask (0-d, float64: exact far past float32's 2**24)."""
        return self.loss_mask.sum(dtype=torch.float64)


def document_ids(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """Number of EOD tokens strictly before each position, per row: 0 for the first document."""
    is_eod = (tokens == eod_token).long()
    # Exclusive cumulative sum: the EOD token itself still belongs to the document it closes.
    return torch.cumsum(is_eod, dim=1) - is_eod


def document_attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: causal, and only between tokens of the same document."""
    T = doc_ids.shape[1]
    causal = torch.ones((T, T), dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (same_doc & causal).unsqueeze(1)


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
    label: Optional[torch.Tensor] = None,
) -> Batch:
    """Inputs, labels, masks and positions from windows `text` of shape [B, T + 1].

    Args:
        eod_mask_loss: no loss where the input is EOD (predicting across a document boundary).
        reset_position_ids: positions restart at each document, as gpt-neox's reset_position_ids.
        reset_attention_mask: tokens attend only within their own document.
        label: [B, T + 1] label windows aligned with `text` (gpt-neox's label datasets): the
            target where >= 0, not trained where -100; None trains on the next token everywhere.
    """
    if text.dim() != 2 or text.shape[1] < 2:
        raise ValueError(
            f"text must be [batch, seq_length + 1] with seq_length >= 1, got {tuple(text.shape)}"
        )
    text = text.long()
    tokens = text[:, :-1].contiguous()
    B, T = tokens.shape
    loss_mask = torch.ones((B, T), dtype=torch.float32, device=text.device)
    if label is None:
        labels = text[:, 1:].contiguous()
    else:
        if label.shape != text.shape:
            raise ValueError(
                f"label windows {tuple(label.shape)} must match the text windows "
                f"{tuple(text.shape)}"
            )
        target = label[:, 1:].long()
        trained = target >= 0
        loss_mask = trained.float()
        # Any valid id where masked: the loss there is computed, then multiplied by 0.
        labels = torch.where(trained, target, torch.zeros_like(target)).contiguous()
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    if reset_position_ids:
        position_ids = document_positions(tokens, eod_token)
    else:
        position_ids = torch.arange(T, device=text.device).expand(B, T).contiguous()
    doc_ids = document_ids(tokens, eod_token) if reset_attention_mask else None
    return Batch(tokens, labels, loss_mask, position_ids, doc_ids)
