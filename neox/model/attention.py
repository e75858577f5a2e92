"""Causal self-attention with fused grouped QKV, rotary/ALiBi, sliding window, packed documents
and four kernels (SDPA, FlexAttention, the Triton softmax, the torch reference)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from neox.config.model import ModelConfig
from neox.kernels.flex_attention import DocumentMask, alibi_score_mod, flex_attention
from neox.model.eager import eager_only
from neox.model.norms import build_norm
from neox.model.positional import alibi_bias, alibi_slopes
from neox.model.rotary import RotaryEmbedding
from neox.plan.attention_path import layer_window, select_attention_path

if TYPE_CHECKING:
    from neox.model.kv_cache import LayerKVCache

ATTENTION_IMPLS = ("flash", "flex", "triton", "torch")


def allowed_mask(
    sq: int,
    sk: int,
    device: torch.device,
    window: Optional[int] = None,
    padding_mask: Optional[torch.Tensor] = None,
    query_slots: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Bool mask, True where query i may attend key j: causal, within the window, not padding.

    Shape (sq, sk), or (B, 1, sq, sk) with a padding mask (B, sk) whose 1/True marks real tokens,
    or with a (B, 1, sq, sk) mask of allowed pairs (documents packed in one sample).
    query_slots (sq,): the key index each query sits at (default the last sq keys), as in a KV
    cache whose later slots are not written yet.
    """
    if query_slots is None:
        query_slots = torch.arange(sk - sq, sk, device=device)
    q_pos = query_slots.to(device).unsqueeze(1)
    k_pos = torch.arange(sk, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos  # (sq, sk)
    if window is not None:
        # gpt-neox passes flash-attn window_size=(width, -1): keys at distance <= width are seen.
        allowed = allowed & (q_pos - k_pos <= window)
    if padding_mask is not None and padding_mask.dim() == 4:
        return allowed & padding_mask.to(device=device, dtype=torch.bool)  # (B, 1, sq, sk)
    if padding_mask is not None:
        keep = padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]  # (B, 1, 1, sk)
        # A query always sees itself, so rows of padding tokens never go all -inf (NaN).
        allowed = allowed & (keep | (k_pos == q_pos))  # (B, 1, sq, sk)
    return allowed


class Attention(nn.Module):
    """Multi-head / grouped-query causal self-attention.

    query_key_value holds, per kv group, its nh/nkv query heads, then its key, then its value;
    for MHA that is HF GPTNeoX's per-head [q, k, v] interleave. num_heads, num_kv_heads,
    head_dim and alibi_slopes are plain attributes that tensor parallelism overwrites with
    per-rank values, so forward reads them and never the config.
    """

    def __init__(self, cfg: ModelConfig, layer_type: str = "global") -> None:
        super().__init__()
        shape = cfg.shape
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = shape.kv_heads
        self.head_dim = hs = shape.head_dim
        self.layer_type = layer_type
        # Kernel on a CUDA device and elsewhere: the model may move after it is built.
        self.impl_cuda = select_attention_path(cfg, layer_type, "cuda").impl
        self.impl_cuda_packed = select_attention_path(cfg, layer_type, "cuda", packed=True).impl
        self.impl_other = select_attention_path(cfg, layer_type, "cpu").impl
        self.window = layer_window(cfg, layer_type)
        self.dropout = cfg.attention_dropout
        self.softmax_in_fp32 = cfg.attention_softmax_in_fp32
        self.scale = 1.0 / math.sqrt(hs)
        qkv_size = (cfg.num_attention_heads + 2 * shape.kv_heads) * hs
        bias = cfg.use_bias_in_attn_linear
        self.query_key_value = nn.Linear(cfg.hidden_size, qkv_size, bias=bias)
        self.dense = nn.Linear(
            cfg.num_attention_heads * hs, cfg.hidden_size, bias=shape.attn_dense_bias
        )
        # Over each head's features, or (projection) over all heads' at once.
        self.qk_whole = cfg.qk_layernorm_scope == "projection"
        q_dim, k_dim = (self.num_heads * hs, self.num_kv_heads * hs) if self.qk_whole else (hs, hs)
        self.q_layernorm = build_norm(cfg, q_dim) if cfg.use_qk_layernorm else None
        self.k_layernorm = build_norm(cfg, k_dim) if cfg.use_qk_layernorm else None
        self.rotary = None
        if cfg.pos_emb == "rotary":
            self.rotary = RotaryEmbedding(
                shape.rotary_dims, cfg.rotary_emb_base, shape.max_positions, shape.rope
            )
        self.alibi_slopes = (
            alibi_slopes(cfg.num_attention_heads) if cfg.pos_emb == "alibi" else None
        )
        # Context parallelism sets it (neox/parallel/context.py): the exchange that gives the
        # kernel the whole sequence for a share of the heads, and back.
        self.context_parallel = None

    def forward(
        self,
        x: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[LayerKVCache] = None,
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); attention_mask (B, T) marks real tokens with 1, (B, 1, T, S)
        marks the allowed query/key pairs (the S cached keys when decoding with kv_cache, which
        stores this step's k and v and returns all S), or a DocumentMask gives each token's
        packed document (reset_attention_mask) and the FlexAttention block masks."""
        B, T, _ = x.shape
        nh, nkv, hs = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.query_key_value(x).view(B, T, nkv, nh // nkv + 2, hs)  # (B, T, nkv, grp+2, hs)
        q = qkv[:, :, :, :-2].reshape(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = qkv[:, :, :, -2].transpose(1, 2)  # (B, nkv, T, hs)
        v = qkv[:, :, :, -1].transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_layernorm is not None and self.qk_whole:
            q = self.q_layernorm(q.transpose(1, 2).reshape(B, T, nh * hs))  # (B, T, nh * hs)
            k = self.k_layernorm(k.transpose(1, 2).reshape(B, T, nkv * hs))
            q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
            k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        elif self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, k, position_ids)
        slots = None
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, nkv, S, hs)
            slots = kv_cache.query_slots()  # where the queries sit among the S keys
        impl = self.kernel(x.device, attention_mask)
        if kv_cache is not None:
            impl = "flash"  # queries are not the last T keys: only SDPA's explicit mask fits
            if T == 1 and slots is not None and kv_cache.owner.attention_reductions:
                impl = "one_query"
        cp = self.context_parallel
        if cp is not None and cp.chunks > 1:
            # The exchange in head groups, each group's kernel between its transfers
            # (context_parallel_chunks): the kernel runs once a group, the mask is built once.
            if isinstance(attention_mask, DocumentMask) and impl != "flex":
                attention_mask = attention_mask.dense()  # (B, 1, T, T), or None: plain causal

            def attend(q, k, v, heads: slice) -> torch.Tensor:
                slopes = None if self.alibi_slopes is None else self.alibi_slopes[heads]
                return self._attend(q, k, v, impl, attention_mask, slots, slopes)

            y = cp.attend_in_groups(q, k, v, attend)  # (B, nh, T, hs): this rank's chunk
        else:
            if cp is not None:
                q, k, v = cp.scatter_heads(q, k, v)  # (B, nh/cp, T*cp, hs)
            y = self._attend(q, k, v, impl, attention_mask, slots, self.alibi_slopes)
            if cp is not None:
                y = cp.gather_heads(y)  # (B, nh, T, hs): this rank's chunk
        y = y.transpose(1, 2).reshape(B, T, nh * hs)  # (B, T, nh*hs)
        return self.dense(y)

    def _attend(self, q, k, v, impl: str, attention_mask, slots, slopes) -> torch.Tensor:
        """The kernel `impl` on q (B, nh, T, hs), k and v (B, nkv, S, hs) -> (B, nh, T, hs);
        slopes: ALiBi's of these heads (None: the layer's own)."""
        group = q.shape[1] // k.shape[1]
        if group > 1:
            # Query head h reads kv head h // (nh / nkv): the grouping of the fused layout.
            k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
            v = v.repeat_interleave(group, dim=1)
        blocks = attention_mask is None or isinstance(attention_mask, DocumentMask)
        if impl == "one_query":
            return self._attend_one_query(q, k, v, attention_mask, slots, slopes)
        if impl == "flex" and blocks and slots is None:
            return self._attend_flex(q, k, v, attention_mask, slopes)
        if isinstance(attention_mask, DocumentMask):
            attention_mask = attention_mask.dense()  # (B, 1, T, T), or None: plain causal
        if impl in ("flash", "flex"):  # flex given a padding mask: SDPA takes it
            return self._attend_sdpa(q, k, v, attention_mask, slots, slopes)
        return self._attend_scores(q, k, v, attention_mask, slopes, fused=impl == "triton")

    def kernel(self, device: torch.device, attention_mask: object = None) -> str:
        """The attention_impl this layer runs on `device` for this kind of attention_mask."""
        if device.type != "cuda":
            return self.impl_other
        packed = (
            isinstance(attention_mask, DocumentMask) and attention_mask.document_ids is not None
        )
        return self.impl_cuda_packed if packed else self.impl_cuda

    def _attend_flex(self, q, k, v, attention_mask: Optional[DocumentMask], slopes=None):
        """FlexAttention over the tiles the block mask allows (causal, window, document), with
        ALiBi's bias added inside the kernel."""
        masks = {} if attention_mask is None else attention_mask.block_masks
        block_mask = masks.get(self.window)
        if block_mask is None:  # not built by the model's forward (e.g. a pipeline stage)
            block_mask = _late_block_mask(attention_mask, q.shape[-2], self.window, q.device)
        score_mod = None
        slopes = self.alibi_slopes if slopes is None else slopes
        if slopes is not None:
            score_mod = alibi_score_mod(torch.tensor(slopes, device=q.device, dtype=torch.float32))
        return flex_attention(q, k, v, block_mask, self.scale, score_mod)

    def _bias(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        slots: Optional[torch.Tensor] = None,
        slopes: Optional[list[float]] = None,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(allowed mask or None when plain causal suffices, ALiBi bias (nh, T, S) or None).
        slots: the queries' key indices when they are not the last T keys (cached decoding);
        slopes: ALiBi's of q's heads (default the layer's)."""
        T, S = q.shape[-2], k.shape[-2]
        plain = self.window is None and attention_mask is None and slots is None
        allowed = None
        if not plain:
            allowed = allowed_mask(T, S, q.device, self.window, attention_mask, slots)
        bias = None
        slopes = self.alibi_slopes if slopes is None else slopes
        if slopes is not None:
            bias = alibi_bias(slopes, T, S, q.device, torch.float32)
        return allowed, bias

    def _attend_sdpa(self, q, k, v, attention_mask, slots=None, slopes=None):
        """torch SDPA: causal flag alone when possible, else an explicit additive mask."""
        dropout = self.dropout if self.training else 0.0
        allowed, bias = self._bias(q, k, attention_mask, slots, slopes)
        if allowed is None and bias is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        if allowed is None:
            allowed = allowed_mask(q.shape[-2], k.shape[-2], q.device)
        mask = torch.zeros(allowed.shape, device=q.device, dtype=q.dtype)
        if bias is not None:
            mask = mask + bias.to(q.dtype)  # (nh, T, S) or (B, nh, T, S)
        mask = mask.masked_fill(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale
        )

    def _attend_one_query(self, q, k, v, attention_mask, slots, slopes=None):
        """One query per row against the cached keys, written out in fp32 (rounded once at the
        end): in a compiled decode step inductor turns both products into reductions over the
        head dim and the slots (neox.inference.decode_compile), where SDPA's kernel is tiled
        for long queries."""
        allowed, bias = self._bias(q, k, attention_mask, slots, slopes)
        scores = (q.float() @ k.float().transpose(-2, -1)) * self.scale  # (B, nh, 1, S)
        if bias is not None:
            scores = scores + bias
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return (scores.softmax(-1) @ v.float()).to(q.dtype)

    def _attend_scores(self, q, k, v, attention_mask, slopes=None, *, fused: bool):
        """Materialised scores, then the Triton fused softmax (fused) or the torch reference."""
        allowed, bias = self._bias(q, k, attention_mask, slopes=slopes)
        scores = q @ k.transpose(-2, -1)  # (B, nh, T, T)
        scale = self.scale
        if bias is not None:
            # ALiBi adds after scaling; fold the scale in so the softmax gets scale 1.
            scores = scores.float() * scale + bias
            scale = 1.0
        if fused:
            pad = None if allowed is None else ~allowed
            probs = _fused_softmax()(scores, scale, causal=True, padding_mask=pad)
        else:
            dtype = torch.float32 if self.softmax_in_fp32 else scores.dtype
            probs = masked_softmax_torch(scores, scale, allowed, dtype)
        probs = F.dropout(probs.to(v.dtype), self.dropout, self.training)
        return probs @ v  # (B, nh, T, hs)


def masked_softmax_torch(
    scores: torch.Tensor, scale: float, allowed: Optional[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """The unfused softmax: cast to ``dtype``, scale, -inf where not ``allowed`` (None: causal)."""
    scores = scores.to(dtype) * scale
    if allowed is None:
        allowed = allowed_mask(*scores.shape[-2:], scores.device)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


@eager_only
def _late_block_mask(mask: Optional[DocumentMask], seq_len: int, window, device) -> object:
    """Build a missing block mask eagerly (a graph break, off the model's usual path)."""
    mask = mask if mask is not None else DocumentMask(None, seq_len)
    return mask.prepare({window}, device).block_masks[window]


def attention_inputs(
    model: nn.Module,
    attention_mask: object,
    input_ids: torch.Tensor,
    kv_cache: object = None,
) -> object:
    """The attention_mask the blocks get: with layers that run FlexAttention on this device,
    a DocumentMask carrying their block masks, built here once rather than in every layer."""
    if kv_cache is not None or not (
        attention_mask is None or isinstance(attention_mask, DocumentMask)
    ):
        return attention_mask
    device = input_ids.device
    # Under context parallelism attention runs over the whole sequence, not this rank's chunk.
    seq_len = input_ids.shape[1] * model.context_parallel_size
    windows = {
        a.window
        for a in model.modules()
        if isinstance(a, Attention) and a.kernel(device, attention_mask) == "flex"
    }
    if not windows:
        return attention_mask
    mask = attention_mask if attention_mask is not None else DocumentMask(None, seq_len)
    return mask.prepare(windows, device)


def _fused_softmax():
    """neox.kernels' Triton scale-mask-softmax (it falls back to its torch reference off GPU)."""
    try:
        from neox.kernels.fused_softmax import scaled_masked_softmax
    except ImportError:
        from neox.kernels.softmax_reference import (
            scaled_masked_softmax_reference as scaled_masked_softmax,
        )
    return scaled_masked_softmax
