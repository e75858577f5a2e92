"""The cached decode step through inductor, with its matrix-vector products as reductions.

A decode step at batch 1 multiplies one row by every weight matrix: GEMVs, bound by reading the
weights. cuBLAS's kernels for such small products (Pythia-410M: 1024 x 3072 and smaller) take
~5 us each on an H100, 40% of copy bandwidth or less, and attention's SDPA kernel, tiled for long
queries, takes ~6 us for one query against 384 cached keys. Inductor writes a product whose left
side has one row as a reduction over each weight row when `coordinate_descent_tuning` is on (its
own `mm` and `bmm` decompositions, the recipe gpt-fast's decode uses) and then fuses the
neighbouring bias, GELU, rounding and residual adds into that kernel. It does so for `mm`, not
for `addmm` (a linear with a bias: every Pythia linear), so `decode_backend` adds that case. The
sum and the bias are taken in fp32 and rounded once, as cuBLAS's bias epilogue does.

The one-query attention against the cache is written out (`Attention._attend_one_query`) when
the cache asks for it (`KVCache.attention_reductions`): inductor then reduces over the head dim
and over the cached slots instead of launching SDPA's kernel.

Both are opt-in: on an H100 they made Pythia-410M's batch-1 step 1.16x faster (0.93 against
1.09 ms) but 1.4B's 2.5% slower, where cuBLAS fills the GPU, and coordinate descent triples the
compile time (docs/benchmarks.md, "Decode near the roofline").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class StepKernels:
    """How a compiled decode step computes its products (see the module docstring)."""

    gemv_reductions: bool = False
    """Linears of one row (batch 1) as coordinate-descent-tuned reductions, not cuBLAS GEMMs."""
    combo_kernels: bool = True
    """Inductor's combo kernels: independent small kernels of a layer (its cache writes, the
    rotations of q and k) launched as one, where a batch-1 step is bound by its kernel count."""
    attention_reductions: bool = False
    """Attention of one query against the cache as reductions, not an SDPA kernel (the
    Generator applies it at batch 1, where it measured faster)."""


# Where a generated reduction beats the library's GEMV (inductor's own rule skips CPU and MPS).
GEMV_DEVICES = frozenset({"cuda"})


def one_row_addmm(bias: torch.Tensor, row: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """bias + row @ weight_t for a (1, K) row, summed in fp32 and rounded once."""
    out = (row.float().unsqueeze(2) * weight_t.float().unsqueeze(0)).sum(dim=1)
    return (out + bias.float()).to(row.dtype)


def _addmm_one_row(original: Callable[..., Any] | None) -> Callable[..., Any]:
    def addmm(bias, mat1, mat2, *args, beta=1, alpha=1, **kwargs):
        one_row = mat1.device.type in GEMV_DEVICES and mat1.shape[0] == 1
        if one_row and beta == 1 and alpha == 1 and not args and not kwargs:
            return one_row_addmm(bias, mat1, mat2)
        if original is None:
            return NotImplemented
        return original(bias, mat1, mat2, *args, beta=beta, alpha=alpha, **kwargs)

    return addmm


def decode_backend(kernels: StepKernels, options: dict[str, Any]) -> Callable[..., Any]:
    """A torch.compile backend: inductor with `options`, and one-row linears as reductions."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    patches = dict(options)
    if kernels.combo_kernels and hasattr(torch._inductor.config, "combo_kernels"):
        patches["combo_kernels"] = True
    table = None
    if kernels.gemv_reductions or kernels.attention_reductions:
        patches["coordinate_descent_tuning"] = True  # inductor's own mm/bmm -> reduction rule
    if kernels.gemv_reductions:
        table = dict(select_decomp_table())
        table[aten.addmm.default] = _addmm_one_row(table.get(aten.addmm.default))

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_fx(gm, example_inputs, config_patches=patches, decompositions=table)

    return backend
