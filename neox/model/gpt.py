"""The GPT-NeoX decoder: token (and learned position) embedding, blocks, final norm, output head."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from neox.config.model import ModelConfig
from neox.model.attention import attention_inputs
from neox.model.block import Block
from neox.model.init import init_parameter
from neox.model.loss import chunked_lm_loss, lm_loss
from neox.model.moe import moe_aux_loss
from neox.model.norms import build_norm

if TYPE_CHECKING:
    from neox.model.kv_cache import KVCache


class GPTNeoX(nn.Module):
    """Decoder-only language model; vocab_size is the padded vocabulary."""

    # The output layer's matmul when set: FP8 (fp8.output_layer) puts a float8 one on a model.
    # Unset, F.linear is looked up at each call, so DeepSpeed's ZeRO-3 linear (which it swaps
    # into torch.nn.functional to release gathered weights after forward) is the one that runs.
    head_linear: Optional[Callable[..., torch.Tensor]] = None
    # Ranks that share each sequence, a chunk each (neox/parallel/context.py sets it): attention
    # masks are built for the whole sequence.
    context_parallel_size: int = 1

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        hidden, shape = cfg.hidden_size, cfg.shape
        self.embed_in = nn.Embedding(vocab_size, hidden)
        self.embed_pos = None
        if cfg.pos_emb == "learned":
            # OPT shifts position ids by opt_pos_emb_offset, so the table is that much longer.
            self.embed_pos = nn.Embedding(shape.position_rows, hidden)
        self.emb_dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(
            Block(cfg, kind, moe=cfg.is_moe_layer(i)) for i, kind in enumerate(shape.layer_types)
        )
        self.final_layer_norm = build_norm(cfg)
        # Tied (the gpt-neox default): logits use embed_in.weight, no second matrix.
        tied = not cfg.no_weight_tying
        self.embed_out = None if tied else nn.Linear(hidden, vocab_size, bias=False)
        # loss(logits, labels, loss_mask); tensor parallelism swaps in the vocab-split one.
        self.lm_loss = lm_loss

    def embed(
        self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """input_ids (B, T) -> hidden states (B, T, C)."""
        x = self.embed_in(input_ids)
        if self.embed_pos is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.embed_pos(position_ids + self.cfg.opt_pos_emb_offset)
        return self.emb_dropout(x)

    def head_weight(self) -> torch.Tensor:
        return self.embed_in.weight if self.embed_out is None else self.embed_out.weight

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection: (B, T, C) -> logits (B, T, V)."""
        linear = self.head_linear or F.linear
        return linear(self.final_layer_norm(x), self.head_weight())

    def loss(
        self, x: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Mean token cross-entropy of the head's predictions from hidden states x (B, T, C)."""
        chunk = self.cfg.lm_loss_chunk_size
        if chunk and self.lm_loss is lm_loss:
            x = self.final_layer_norm(x)
            return chunked_lm_loss(x, self.head_weight(), labels, loss_mask, chunk)
        return self.lm_loss(self.head(x), labels, loss_mask)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) for input_ids (B, T), or with labels (B, T) the scalar training loss.

        attention_mask (B, T) marks real tokens; a DocumentMask (neox.kernels.flex_attention)
        keeps packed documents apart. Computing the loss here, inside the module the
        engine runs, lets the loss be fused with the output layer (lm_loss_chunk_size).
        Decoding passes a KVCache (neox.model.kv_cache), explicit position_ids and the
        (B, 1, T, S) mask of cached keys each query may see.
        """
        x = self.embed(input_ids, position_ids)
        attention_mask = attention_inputs(self, attention_mask, input_ids, kv_cache)
        for i, block in enumerate(self.layers):
            x = block(x, position_ids, attention_mask, None if kv_cache is None else kv_cache[i])
        if labels is None:
            return self.head(x)
        loss = self.loss(x, labels, loss_mask)
        if self.training and self.cfg.moe_num_experts > 1:
            loss = loss + moe_aux_loss(self.layers)  # the router losses train, never evaluate
        return loss

    @torch.no_grad()
    def reset_parameters(self, seed: int = 1234) -> None:
        """Initialise every parameter from init_parameter(its name), independent of layout."""
        for name, param in self.named_parameters():
            param.copy_(init_parameter(name, param.shape, self.cfg, seed))
