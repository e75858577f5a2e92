"""Block-sparse attention for packed documents and sliding windows through torch FlexAttention.

A BlockMask lists, per 128 x 128 tile of (query, key), whether the tile is fully allowed, partly
allowed (the kernel then evaluates the mask per element) or empty (skipped, never computed): the
T x T mask is never materialised. Tiles are classified here from the document ids a chunk of
query rows at a time, so memory stays bounded at any sequence length and nothing is compiled.

FlexAttention computes its softmax in float32 (running max and sum, like flash attention) for
bf16/fp16 inputs. It has no backward on CPU: off CUDA the model takes SDPA with the dense mask
(`allowed`), which is also the reference these masks are tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

BLOCK = 128  # FlexAttention's default tile (queries x keys)
_CHUNK_ELEMENTS = 1 << 26  # bool elements materialised at once while classifying tiles


def allowed(
    document_ids: Optional[torch.Tensor], sq: int, sk: int, device, window: Optional[int] = None
) -> torch.Tensor:
    """Dense bool mask, True where query i may attend key j: causal (queries are the last sq
    keys), at distance <= window, same document. (sq, sk), or (B, 1, sq, sk) with document ids."""
    q_pos = torch.arange(sk - sq, sk, device=device)[:, None]
    k_pos = torch.arange(sk, device=device)[None, :]
    ok = k_pos <= q_pos  # (sq, sk)
    if window is not None:
        ok = ok & (q_pos - k_pos <= window)
    if document_ids is None:
        return ok
    doc = document_ids.to(device)
    same = doc[:, sk - sq :, None] == doc[:, None, :]  # (B, sq, sk)
    return (same & ok).unsqueeze(1)  # (B, 1, sq, sk)


def _mask_mod(document_ids: Optional[torch.Tensor], window: Optional[int]):
    """The per-element rule FlexAttention evaluates inside partial tiles (same as `allowed`)."""

    def causal(b, h, q, k):
        return k <= q

    def windowed(b, h, q, k):
        return (k <= q) & (q - k <= window)

    base = causal if window is None else windowed
    if document_ids is None:
        return base
    doc = document_ids

    def documents(b, h, q, k):
        return base(b, h, q, k) & (doc[b, q] == doc[b, k])

    return documents


def build_block_mask(
    document_ids: Optional[torch.Tensor],
    seq_len: int,
    window: Optional[int] = None,
    device: Any = None,
):
    """BlockMask of causal attention within `window` and within documents (B, T) if given.

    A tile is full when every pair in it is allowed, partial when some are; a tile holding a
    document boundary is partial, so the boundary may fall anywhere, inside a tile too.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if device is None:
        device = "cpu" if document_ids is None else document_ids.device
    device = torch.device(device)
    T = seq_len
    nb = -(-T // BLOCK)
    padded = nb * BLOCK
    B = 1 if document_ids is None else document_ids.shape[0]
    doc = None
    if document_ids is not None:
        # Tiles are padded to a whole tile; padded positions are never allowed (below), and the
        # mask_mod may still read their document id, so it exists.
        doc = torch.full((B, padded), -1, dtype=torch.int32, device=device)
        doc[:, :T] = document_ids.to(device=device, dtype=torch.int32)
    k_pos = torch.arange(padded, device=device)
    k_real = k_pos < T
    rows = max(BLOCK, (_CHUNK_ELEMENTS // max(1, B * padded)) // BLOCK * BLOCK)
    any_parts, all_parts = [], []
    for start in range(0, padded, rows):
        q_pos = torch.arange(start, min(start + rows, padded), device=device)
        ok = (k_pos[None, :] <= q_pos[:, None]) & k_real[None, :] & (q_pos[:, None] < T)
        if window is not None:
            ok = ok & (q_pos[:, None] - k_pos[None, :] <= window)
        ok = ok.expand(B, *ok.shape)  # (B, rows, padded)
        if doc is not None:
            ok = ok & (doc[:, q_pos, None] == doc[:, None, :])
        tiles = ok.reshape(B, -1, BLOCK, nb, BLOCK)
        any_parts.append(tiles.any(dim=4).any(dim=2))  # (B, rows/BLOCK, nb)
        all_parts.append(tiles.all(dim=4).all(dim=2))
    full = torch.cat(all_parts, dim=1)  # (B, nb, nb)
    partial = torch.cat(any_parts, dim=1) & ~full

    def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Counts per query tile, and the key tiles' indices with the listed ones first.
        counts = tiles.sum(dim=-1, dtype=torch.int32)
        order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
        return counts[:, None], order.to(torch.int32)[:, None]  # (B, 1, nb), (B, 1, nb, nb)

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=_mask_mod(doc, window),
        seq_lengths=(T, T),
    )


@functools.lru_cache(maxsize=16)
def causal_block_mask(seq_len: int, window: Optional[int], device: torch.device):
    """The document-free mask of one length and window, built once (it never changes)."""
    return build_block_mask(None, seq_len, window, device)


@dataclass
class DocumentMask:
    """The model's attention_mask for packed documents (reset_attention_mask) and for layers
    that run FlexAttention: each token's document, plus the BlockMask of each window those
    layers use, built once per forward before the (compiled) blocks read them."""

    document_ids: Optional[torch.Tensor]
    """(B, T) int, nondecreasing along each row (documents ended before each token); None:
    each row is one document (plain causal attention)."""
    seq_len: int
    block_masks: dict[Optional[int], Any] = field(default_factory=dict)
    """Sliding window (None: full causal) -> BlockMask over (seq_len, seq_len)."""

    def dense(self, window: Optional[int] = None, device: Any = None) -> Optional[torch.Tensor]:
        """(B, 1, T, T) bool of the allowed pairs for kernels that take a dense mask (None when
        there are no documents: plain causal within `window`)."""
        if self.document_ids is None:
            return None
        device = device if device is not None else self.document_ids.device
        return allowed(self.document_ids, self.seq_len, self.seq_len, device, window)

    def prepare(self, windows: set[Optional[int]], device: Any) -> DocumentMask:
        """Build the BlockMasks of `windows` on `device` (outside any compiled region)."""
        for window in windows - self.block_masks.keys():
            if self.document_ids is None:
                mask = causal_block_mask(self.seq_len, window, torch.device(device))
            else:
                mask = build_block_mask(self.document_ids, self.seq_len, window, device)
            self.block_masks[window] = mask
        return self


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=False)


def alibi_score_mod(slopes: torch.Tensor):
    """ALiBi inside the kernel: score - slope[head] * (query position - key position)."""

    def alibi(score, b, h, q, k):
        return score - slopes[h] * (q - k)

    return alibi


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask,
    scale: float,
    score_mod=None,
):
    """FlexAttention compiled (its eager form materialises scores); (B, nh, T, hs) each.
    score_mod (e.g. alibi_score_mod) adds to the scaled scores, as an additive mask would."""
    kwargs = dict(block_mask=block_mask, scale=scale, score_mod=score_mod)
    if torch.compiler.is_compiling():
        # Inside a compiled block: the block's graph takes the kernel in, nothing to wrap.
        from torch.nn.attention.flex_attention import flex_attention as flex

        return flex(q, k, v, **kwargs)
    return _compiled_flex()(q, k, v, **kwargs)
