"""A preallocated (static) key/value cache: one (B, nkv, S, hs) buffer pair per layer.

The buffers never change shape, so a decode step has the same shapes every token (ready for
CUDA graphs); the caller says where this step's keys go (`KVCache.position`, a device tensor)
and masks the slots not written yet. A prefill (`at(..., prefill=True)`) stores the prompt's keys
but attends over those alone, so attention takes training's path (causal SDPA) instead of a
masked pass over the whole buffer.
"""

from __future__ import annotations

import torch
from torch import nn


class LayerKVCache:
    """Keys and values of one attention layer; `update` writes this step's and returns all."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, owner: KVCache) -> None:
        self.k, self.v = k, v  # (B, nkv, S, hs)
        self.owner = owner

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nkv, T, hs) at slots owner.position (T,); return (B, nkv, S, hs) each,
        or k, v themselves in a prefill (the prompt's T keys are all a prompt query may see)."""
        self.k.index_copy_(2, self.owner.position, k.to(self.k.dtype))
        self.v.index_copy_(2, self.owner.position, v.to(self.v.dtype))
        if self.owner.prefill:
            return k, v
        return self.k, self.v

    def query_slots(self) -> torch.Tensor | None:
        """The key index of each query among the keys `update` returned: None in a prefill
        (the queries are those T keys), else the slots being written. Sliding windows measure
        distances from them, so a decode step sees exactly the keys a full forward would (slots
        and positions differ by the row's left padding, a constant)."""
        return None if self.owner.prefill else self.owner.position


class KVCache:
    """The per-layer caches of a GPTNeoX for `batch` sequences of up to `length` tokens."""

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        length: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.length = length
        # Slots written by the current step; set with `at` before each forward.
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.prefill = False
        # Decode steps attend with plain arithmetic (Attention._attend_one_query) instead of
        # SDPA: set by a Generator whose compiled step makes it reductions.
        self.attention_reductions = False
        self.layers = []
        for block in model.layers:
            attn = block.attention
            # num_kv_heads is per rank under tensor parallelism (see Attention).
            shape = (batch, attn.num_kv_heads, length, attn.head_dim)
            k = torch.zeros(shape, dtype=dtype, device=device)
            self.layers.append(LayerKVCache(k, torch.zeros_like(k), self))

    def __getitem__(self, layer: int) -> LayerKVCache:
        return self.layers[layer]

    def at(self, position: torch.Tensor, prefill: bool = False) -> KVCache:
        """Point the next forward's writes at slots `position` (T,); returns self. prefill: the
        forward's tokens are a whole prompt starting at slot 0 (its queries see only its keys)."""
        self.position = position
        self.prefill = prefill
        return self

    @staticmethod
    def supports(model: nn.Module) -> str | None:
        """None if cached decoding reproduces the full forward for this model, else why not.

        ALiBi measures distances from the last key, which a decode step against the whole buffer
        is not; sliding windows measure from the query's slot (`LayerKVCache.query_slots`).
        """
        for block in model.layers:
            if block.attention.alibi_slopes is not None:
                return "ALiBi position embeddings"
        return None
