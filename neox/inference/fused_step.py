"""The cached decode step of a few rows through neox.kernels.decode: three kernels a layer.

A parallel-residual layer (Pythia, GPT-J) runs as (1) both norms and the QKV and first MLP
products, activation included, in one launch; (2) rotary, the cache write and attention over the
written slots; (3) the attention output projection, the MLP's second product and both residual
adds. A sequential layer (Llama, Mistral) takes five: the attention half, then the MLP half.
The embedding, final norm + head (one launch) and the greedy choice stay as they are. No
compilation: the step is captured as a CUDA graph as it runs (neox.inference.graphed).

`FusedStep.unsupported(model)` says why a model cannot take this path (the Generator then uses
the compiled or the eager step): ALiBi, query/key norms, ScaleNorm, mixture-of-experts MLPs,
dynamic NTK rotary (its table changes with the length), linears that are not plain `nn.Linear`
(tensor-parallel or LoRA layers) or a float8 output layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from neox.model.kv_cache import KVCache
from neox.model.mlp import activation_name
from neox.model.moe import MoE
from neox.model.norms import LayerNorm, RMSNorm


def _norm_kind(norm: nn.Module) -> Optional[str]:
    if isinstance(norm, LayerNorm):
        return "layernorm"
    if isinstance(norm, RMSNorm):
        return "rmsnorm"
    return None


def _norm_weights(norm: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    return norm.weight, getattr(norm, "bias", None)


@dataclass
class _Layer:
    parallel: bool
    ln1: tuple[torch.Tensor, Optional[torch.Tensor]]
    ln2: tuple[torch.Tensor, Optional[torch.Tensor]]
    qkv: object  # LinearPart
    up: object  # LinearPart: the MLP's first product(s) and activation
    dense: tuple[torch.Tensor, Optional[torch.Tensor]]
    down: tuple[torch.Tensor, Optional[torch.Tensor]]
    rotary: Optional[nn.Module]
    num_heads: int
    scale: float
    window: Optional[int]


class FusedStep:
    """Logits (R, V) of one cached decode step of `model` for R rows (`takes`)."""

    greedy_kernel = True
    """Make the greedy choice and its bookkeeping one kernel (`choose_greedy`): one launch
    of ~4 us where torch's argmax and bookkeeping take ~9 launches and ~30 us a step on an
    H100 (docs/benchmarks.md). False: torch's ops, as the other steps."""

    def __init__(self, model: nn.Module) -> None:
        from neox.kernels.decode import LinearPart

        problem = self.unsupported(model)
        if problem:
            raise ValueError(f"the fused decode step does not support {problem}")
        self.model = model
        first = model.layers[0].input_layernorm
        self.norm, self.eps = _norm_kind(first), first.eps
        act = activation_name(model.cfg)
        self.layers = []
        for block in model.layers:
            attn, mlp = block.attention, block.mlp
            ln2 = block.post_attention_layernorm or block.input_layernorm
            up = mlp.dense_h_to_4h
            gate = mlp.gate
            self.layers.append(
                _Layer(
                    parallel=block.parallel_residual,
                    ln1=_norm_weights(block.input_layernorm),
                    ln2=_norm_weights(ln2),
                    qkv=LinearPart(attn.query_key_value.weight, attn.query_key_value.bias),
                    up=LinearPart(
                        up.weight,
                        up.bias,
                        act,
                        None if gate is None else gate.weight,
                        None if gate is None else gate.bias,
                    ),
                    dense=(attn.dense.weight, attn.dense.bias),
                    down=(mlp.dense_4h_to_h.weight, mlp.dense_4h_to_h.bias),
                    rotary=attn.rotary,
                    num_heads=attn.num_heads,
                    scale=attn.scale,
                    window=attn.window,
                )
            )
        final = model.final_layer_norm
        self.final = _norm_weights(final)
        self.head = LinearPart(model.head_weight())
        self._scratch: dict[tuple, object] = {}
        self._greedy: dict[tuple, object] = {}

    @staticmethod
    def takes(rows: int) -> bool:
        """Whether the kernels take a batch of `rows` (1, 2 or 4)."""
        from neox.kernels.decode import MAX_ROWS

        return rows <= MAX_ROWS and rows & (rows - 1) == 0

    @staticmethod
    def unsupported(model: nn.Module) -> Optional[str]:
        """None if this step computes what the model's own forward does, else what it lacks."""
        if getattr(model, "head_linear", None) is not None:
            return "a float8 output layer"
        norms = {_norm_kind(model.final_layer_norm)}
        for block in model.layers:
            attn, mlp = block.attention, block.mlp
            if isinstance(mlp, MoE):
                return "mixture-of-experts MLPs"
            norms |= {_norm_kind(block.input_layernorm)}
            if block.post_attention_layernorm is not None:
                norms |= {_norm_kind(block.post_attention_layernorm)}
            if attn.alibi_slopes is not None:
                return "ALiBi position embeddings"
            if attn.q_layernorm is not None:
                return "query/key layer norms"
            rotary = attn.rotary
            if rotary is not None and rotary.scaling is not None:
                if rotary.scaling.rope_type == "dynamic":
                    return "dynamic NTK rotary scaling"
            if rotary is not None and rotary.dim % 2:
                return "an odd rotary width"
            linears = [attn.query_key_value, attn.dense, mlp.dense_h_to_4h, mlp.dense_4h_to_h]
            linears += [mlp.gate] if mlp.gate is not None else []
            if any(type(m) is not nn.Linear for m in linears):
                return "linears other than nn.Linear (tensor-parallel or adapter layers)"
        if None in norms:
            return "norms other than LayerNorm and RMSNorm"
        if len({type(n) for n in (model.final_layer_norm, model.layers[0].input_layernorm)}) > 1:
            return "mixed norm kinds"
        from neox.kernels.decode import ACTIVATIONS

        if activation_name(model.cfg) not in ACTIVATIONS:
            return f"the activation {activation_name(model.cfg)!r}"
        return None

    def __call__(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        cache: KVCache,
        slot: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (R, V) for tokens tok (R,) at positions pos (R, 1), their keys written at cache
        slot `slot` (1,); valid (R, S) marks the slots each row may see, this one included."""
        from neox.kernels.decode import (
            AttentionScratch,
            cached_attention,
            linear_residual,
            norm_linear,
        )

        x = self.model.embed(tok[:, None], pos)[:, 0]  # (R, C)
        S = cache.length
        first = cache.layers[0].k
        rows = tok.shape[0]
        key = (rows, S, first.device)
        if key not in self._scratch:  # made on the first (uncaptured) call of a session
            heads, hs = self.layers[0].num_heads, first.shape[-1]
            self._scratch = {key: AttentionScratch(rows, heads, hs, S, x.device)}
        scratch = self._scratch[key]
        for layer, kv in zip(self.layers, cache.layers):
            cos = sin = None
            if layer.rotary is not None:
                cos, sin = layer.rotary.cos_sin(S, x.device, x.dtype)
            if layer.parallel:
                qkv, h = norm_linear(
                    x, self.norm, self.eps, layer.ln1, layer.qkv, layer.up, layer.ln2
                )
            else:
                qkv, _ = norm_linear(x, self.norm, self.eps, layer.ln1, layer.qkv)
            y = cached_attention(
                qkv, cos, sin, pos, slot, valid, kv.k, kv.v, layer.num_heads, layer.scale,
                layer.window, scratch,
            )  # fmt: skip
            if layer.parallel:
                x = linear_residual(x, y, *layer.dense, h, *layer.down)
            else:
                x = linear_residual(x, y, *layer.dense)
                h, _ = norm_linear(x, self.norm, self.eps, layer.ln2, layer.up)
                x = linear_residual(x, h, *layer.down)
        logits, _ = norm_linear(x, self.norm, self.eps, self.final, self.head)
        return logits

    def choose_greedy(self, logits: torch.Tensor, state, vocab: int, eod: int) -> None:
        """The Generator's greedy `_choose` (argmax over the real vocabulary, `eod` for ended
        rows, its bookkeeping into state) as one kernel, where torch takes ~9 (its argmax of
        one 50k-wide row alone ~16 us on an H100)."""
        from neox.kernels.decode import GreedyScratch, greedy_choice

        key = (logits.shape[0], vocab, logits.device)
        if key not in self._greedy:  # made on the first (uncaptured) call of a session
            self._greedy = {key: GreedyScratch(logits.shape[0], vocab, logits.device)}
        greedy_choice(
            logits, vocab, eod, state.finished, state.tokens, state.logits, state.tok,
            state.slot, self._greedy[key],
        )  # fmt: skip
