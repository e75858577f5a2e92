"""Triton kernels for a decode step of a few rows: a layer in three launches, not thirty.

At batch 1 a decode step reads every weight once and does little else, so its time is the weight
bytes over the memory bandwidth plus a fixed cost per kernel (~2-3 us on an H100, even replayed
from a CUDA graph). Inductor's compiled step still runs ~9 kernels a layer (cuBLAS GEMVs that
leave most of a small matrix's SMs idle, SDPA tiled for long queries, and small fused Triton
kernels between them); no library fuses a layer's norm, products, rotary, cache write and
attention, so these kernels are written here:

- `norm_linear`: norm(x) @ W.T + bias, then an activation (or a gated pair), for one or two
  weight matrices sharing the input rows (a parallel-residual layer's QKV and its MLP's first
  linear, each with its own norm). Each program produces BLOCK_N outputs; where the whole row
  fits in registers (K <= 8192 at batch 1) it issues the load of its [BLOCK_N, K] weights and
  of the input rows at once and normalises the rows in registers, so a program waits for
  memory once.
- `cached_attention`: rotary on q and the new k, the new k and v written into the cache at this
  step's slot, and attention of the one query against the slots written so far (online softmax
  in fp32), split over up to 16 programs per (row, head); the last program of a head to finish
  combines the splits.
- `linear_residual`: x + (y @ W1.T + b1) [+ (h @ W2.T + b2)]: a layer's attention output
  projection and (parallel residual) its MLP's second linear, with the residual adds.

The arithmetic follows the eager bf16 step's rounding points: norms, each linear (fp32 sum, bias
added before one rounding, as cuBLAS's epilogue), the activation, each rotary product and sum, and
each residual add round to the model dtype where torch would, so greedy tokens track the eager
path's (tests/kernels/decode_interpreter_helpers.py, tests/inference/test_generate_gpu.py).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "silu": 4}
NORMS = {None: 0, "layernorm": 1, "rmsnorm": 2}
MAX_ROWS = 4
"""The most rows (batch) these kernels take: each program keeps a [rows, BLOCK_N, BLOCK_K]
product in registers; at batch 16 a step is no longer bound by its kernel count."""
ROW_ELEMENTS = 8192
"""rows x BLOCK_K: the most input elements a program holds at once."""

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton's interpreter truncates fp32 -> bf16 where GPUs round to nearest even: under it,
# `_round` rounds with integer arithmetic instead, so CPU tests check the GPU's arithmetic.
_BITWISE_BF16 = tl.constexpr(INTERPRET)

try:  # programmatic dependent launch (Hopper and later; Triton >= 3.3)
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__ and not INTERPRET
except ImportError:  # pragma: no cover (an older Triton)
    _HAS_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


PDL = True
"""Launch each kernel while the one before it finishes (programmatic dependent launch, on
devices of compute capability 9 and later): a kernel loads its weights (and whatever earlier
kernels wrote), then waits for the previous kernel, so the ~2 us a kernel takes to fill the GPU
overlaps the previous one's tail. Off: each kernel starts after the previous one ends."""


@functools.lru_cache
def _hopper_or_later(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _pdl(device: torch.device) -> bool:
    return PDL and _HAS_PDL and _hopper_or_later(device)


def _block_k(K: int, rows: int) -> int:
    """The chunk of K a program loads at once: all of it when it fits."""
    return min(triton.next_power_of_2(K), ROW_ELEMENTS // rows)


def _configs() -> list[triton.Config]:
    """BLOCK_N x num_warps; the interpreter gets one (its autotuning would time each on the
    CPU)."""
    blocks = [(n, w) for w in (4, 8) for n in (1, 2, 4, 8, 16, 32)]
    if INTERPRET:
        blocks = [(4, 4)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in blocks]


def _prune(configs, named_args, **kwargs):
    """Keep configs whose [rows, BLOCK_N, BLOCK_K] product fits in registers (64 fp32 values a
    thread)."""
    args = {**named_args, **kwargs}
    rows = args["ROWS"]
    width = max(v for k, v in args.items() if k.startswith("BLOCK_K"))

    def fits(c: triton.Config) -> bool:
        return rows * c.kwargs["BLOCK_N"] * width <= 64 * 32 * c.num_warps

    kept = [c for c in configs if fits(c)]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_N"])]


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x rounded to the model dtype and back to fp32: where eager stores a tensor."""
    if _BITWISE_BF16 and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == 1:  # gelu (erf)
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh approximation: tanh(u) = 1 - 2 / (exp(2u) + 1)
        u = tl.minimum(tl.maximum(0.7978845608028654 * (x + 0.044715 * x * x * x), -20.0), 20.0)
        x = 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    elif ACT == 3:
        x = tl.maximum(x, 0.0)
    elif ACT == 4:
        x = x * tl.sigmoid(x)
    return x


@triton.jit
def _normalise(xv, km, mean, rstd, kk, g_ptr, nb_ptr,
               NORM: tl.constexpr, NORM_BIAS: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """Columns kk of norm(x) from x's columns xv [ROWS, BLOCK_K], as the eager norm rounds."""
    if NORM == 1:  # LayerNorm: one rounding after the affine
        g = tl.load(g_ptr + kk, mask=km, other=0.0).to(tl.float32)
        xv = (xv - mean[:, None]) * rstd[:, None] * g[None, :]
        if NORM_BIAS:
            xv += tl.load(nb_ptr + kk, mask=km, other=0.0).to(tl.float32)[None, :]
        xv = _round(xv, DTYPE)
    elif NORM == 2:  # RMSNorm: normalised, rounded, then scaled and rounded (neox.model.norms)
        g = tl.load(g_ptr + kk, mask=km, other=0.0).to(tl.float32)
        xv = _round(_round(xv * rstd[:, None], DTYPE) * g[None, :], DTYPE)
    return xv


@triton.jit
def _stats(xv, km, K, eps, NORM: tl.constexpr):
    """(mean, 1/std) of rows xv [ROWS, BLOCK_K] holding all K columns (RMSNorm: mean 0)."""
    if NORM == 1:
        mean = tl.sum(xv, axis=1) / K
        xc = tl.where(km[None, :], xv - mean[:, None], 0.0)
        return mean, tl.math.rsqrt(tl.sum(xc * xc, axis=1) / K + eps)
    return tl.sum(xv, axis=1) * 0.0, tl.math.rsqrt(tl.sum(xv * xv, axis=1) / K + eps)


@triton.jit
def _norm_stats(x_ptr, K, eps, ROWS: tl.constexpr, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_stats` for rows longer than a block: two passes over x, as exact as torch's own."""
    r = tl.arange(0, ROWS)
    mean = tl.zeros([ROWS], dtype=tl.float32)
    if NORM == 1:
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + r[:, None] * K + kk[None, :], mask=kk[None, :] < K, other=0.0)
            mean += tl.sum(xv.to(tl.float32), axis=1)
        mean = mean / K
    sq = tl.zeros([ROWS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk[None, :] < K
        xv = tl.load(x_ptr + r[:, None] * K + kk[None, :], mask=km, other=0.0).to(tl.float32)
        xc = tl.where(km, xv - mean[:, None], 0.0)
        sq += tl.sum(xc * xc, axis=1)
    return mean, tl.math.rsqrt(sq / K + eps)


@triton.jit
def _norm_linear_part(
    x_ptr, K, eps, g_ptr, nb_ptr, w_ptr, b_ptr, gw_ptr, gb_ptr, out_ptr, N, blk,
    ROWS: tl.constexpr, NORM: tl.constexpr, NORM_BIAS: tl.constexpr, BIAS: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, DTYPE: tl.constexpr, ONE_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    r = tl.arange(0, ROWS)
    n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    gacc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if ONE_BLOCK:  # the weights' load first, then the rows, normalised in registers
        kk = tl.arange(0, BLOCK_K)
        km = kk < K
        wm = nm[:, None] & km[None, :]
        w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=wm, other=0.0)
        if GATED:
            gw = tl.load(gw_ptr + n[:, None] * K + kk[None, :], mask=wm, other=0.0)
        if USE_PDL:  # x is the previous kernel's output
            gdc_wait()
            gdc_launch_dependents()
        xv = tl.load(x_ptr + r[:, None] * K + kk[None, :], mask=km[None, :], other=0.0)
        xv = xv.to(tl.float32)
        mean = tl.zeros([ROWS], dtype=tl.float32)
        rstd = tl.full([ROWS], 1.0, dtype=tl.float32)
        if NORM != 0:
            mean, rstd = _stats(xv, km, K, eps, NORM)
        xn = _normalise(xv, km, mean, rstd, kk, g_ptr, nb_ptr, NORM, NORM_BIAS, DTYPE)
        acc += tl.sum(xn[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if GATED:
            gacc += tl.sum(xn[:, None, :] * gw.to(tl.float32)[None, :, :], axis=2)
    else:
        if USE_PDL:
            gdc_wait()
            gdc_launch_dependents()
        mean = tl.zeros([ROWS], dtype=tl.float32)
        rstd = tl.full([ROWS], 1.0, dtype=tl.float32)
        if NORM != 0:
            mean, rstd = _norm_stats(x_ptr, K, eps, ROWS, NORM, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < K
            wm = nm[:, None] & km[None, :]
            w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=wm, other=0.0)
            xv = tl.load(x_ptr + r[:, None] * K + kk[None, :], mask=km[None, :], other=0.0)
            xn = _normalise(
                xv.to(tl.float32), km, mean, rstd, kk, g_ptr, nb_ptr, NORM, NORM_BIAS, DTYPE
            )
            acc += tl.sum(xn[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            if GATED:
                gw = tl.load(gw_ptr + n[:, None] * K + kk[None, :], mask=wm, other=0.0)
                gacc += tl.sum(xn[:, None, :] * gw.to(tl.float32)[None, :, :], axis=2)
    if BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        if GATED:
            gacc += tl.load(gb_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    y = _round(acc, DTYPE)
    if GATED:  # act(gate(x)) * up(x), each rounded as eager rounds it
        y = _round(_round(_activation(_round(gacc, DTYPE), ACT), DTYPE) * y, DTYPE)
    elif ACT != 0:
        y = _round(_activation(y, ACT), DTYPE)
    tl.store(out_ptr + r[:, None] * N + n[None, :], y.to(DTYPE), mask=nm[None, :])


@triton.autotune(
    configs=_configs(),
    key=["K", "NA", "NB", "ROWS"],
    prune_configs_by={"early_config_prune": _prune},
    cache_results=True,  # tuned once per machine and shape: a new process reuses it
)
@triton.jit
def _norm_linear_kernel(
    x_ptr, K, eps,
    ga_ptr, nba_ptr, wa_ptr, ba_ptr, gwa_ptr, gba_ptr, outa_ptr, NA,
    gb_ptr, nbb_ptr, wb_ptr, bb_ptr, gwb_ptr, gbb_ptr, outb_ptr, NB,
    ROWS: tl.constexpr, NORM: tl.constexpr, NORM_BIAS: tl.constexpr, DTYPE: tl.constexpr,
    BIAS_A: tl.constexpr, GATED_A: tl.constexpr, ACT_A: tl.constexpr,
    BIAS_B: tl.constexpr, GATED_B: tl.constexpr, ACT_B: tl.constexpr,
    ONE_BLOCK: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    blocks_a = tl.cdiv(NA, BLOCK_N)
    if pid < blocks_a:
        _norm_linear_part(
            x_ptr, K, eps, ga_ptr, nba_ptr, wa_ptr, ba_ptr, gwa_ptr, gba_ptr, outa_ptr, NA, pid,
            ROWS, NORM, NORM_BIAS, BIAS_A, GATED_A, ACT_A, DTYPE, ONE_BLOCK, USE_PDL, BLOCK_N,
            BLOCK_K,
        )  # fmt: skip
    else:
        _norm_linear_part(
            x_ptr, K, eps, gb_ptr, nbb_ptr, wb_ptr, bb_ptr, gwb_ptr, gbb_ptr, outb_ptr, NB,
            pid - blocks_a,
            ROWS, NORM, NORM_BIAS, BIAS_B, GATED_B, ACT_B, DTYPE, ONE_BLOCK, USE_PDL, BLOCK_N,
            BLOCK_K,
        )  # fmt: skip


class LinearPart:
    """One weight matrix of `norm_linear`: out = act(x_n @ weight.T + bias), or for a gated MLP
    act(x_n @ gate.T + gate_bias) * (x_n @ weight.T + bias)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str | None = None,
        gate: torch.Tensor | None = None,
        gate_bias: torch.Tensor | None = None,
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} not one of {list(ACTIVATIONS)}")
        if gate is not None and (bias is None) != (gate_bias is None):
            raise ValueError("a gated part has biases on both its products or on neither")
        self.weight, self.bias, self.activation = weight, bias, activation
        self.gate, self.gate_bias = gate, gate_bias

    def args(self, out: torch.Tensor) -> list:
        w = self.weight
        b = self.bias if self.bias is not None else w
        gw = self.gate if self.gate is not None else w
        gb = self.gate_bias if self.gate_bias is not None else b
        return [w, b, gw, gb, out, w.shape[0]]

    def flags(self) -> list:
        return [self.bias is not None, self.gate is not None, ACTIVATIONS[self.activation]]


def _check_rows(rows: int) -> None:
    if rows > MAX_ROWS or rows & (rows - 1):
        raise ValueError(f"{rows} rows: these kernels take 1, 2 or 4")


def norm_linear(
    x: torch.Tensor,
    norm: str | None,
    eps: float,
    norm_weights: tuple[torch.Tensor | None, torch.Tensor | None],
    a: LinearPart,
    b: LinearPart | None = None,
    norm_weights_b: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out_a (R, Na), out_b (R, Nb) or None) for x (R, K): part a of norm_a(x), part b of
    norm_b(x) (the same kind of norm, its own weights), in one launch. norm_weights: (weight,
    bias or None) of the norm, or (None, None) without one."""
    rows, K = x.shape
    _check_rows(rows)
    x = x.contiguous()
    out_a = x.new_empty((rows, a.weight.shape[0]))
    out_b = x.new_empty((rows, b.weight.shape[0])) if b is not None else None
    ga, nba = norm_weights
    gb_, nbb = norm_weights_b or norm_weights
    ga, gb_ = (ga if ga is not None else x), (gb_ if gb_ is not None else x)
    nba, nbb = (nba if nba is not None else ga), (nbb if nbb is not None else gb_)
    part_b = b if b is not None else a
    args_b = part_b.args(out_b if out_b is not None else out_a)
    if b is None:
        args_b[-1] = 0  # no rows in part b
    block_k = _block_k(K, rows)
    pdl = _pdl(x.device)
    (bias_a, gated_a, act_a), (bias_b, gated_b, act_b) = a.flags(), part_b.flags()

    def grid(meta):
        blocks = triton.cdiv(a.weight.shape[0], meta["BLOCK_N"])
        return (blocks + triton.cdiv(args_b[-1], meta["BLOCK_N"]),)

    _norm_linear_kernel[grid](
        x, K, eps,
        ga, nba, *a.args(out_a),
        gb_, nbb, *args_b,
        ROWS=rows, NORM=NORMS[norm], NORM_BIAS=norm_weights[1] is not None,
        DTYPE=_tl_dtype(x.dtype), BIAS_A=bias_a, GATED_A=gated_a, ACT_A=act_a,
        BIAS_B=bias_b, GATED_B=gated_b, ACT_B=act_b,
        ONE_BLOCK=block_k >= K, BLOCK_K=block_k, USE_PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return out_a, out_b


@triton.jit
def _gemv_part(y_ptr, K, w_ptr, n, nm, w, ROWS: tl.constexpr, ONE_BLOCK: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """y @ W.T for output columns n: [ROWS, BLOCK_N] in fp32; w is the weights' single block
    loaded already (ONE_BLOCK), else they are loaded here block by block."""
    r = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if ONE_BLOCK:
        kk = tl.arange(0, BLOCK_K)
        yv = tl.load(y_ptr + r[:, None] * K + kk[None, :], mask=kk[None, :] < K, other=0.0)
        acc += tl.sum(yv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    else:
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < K
            wm = nm[:, None] & km[None, :]
            wb = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=wm, other=0.0)
            yv = tl.load(y_ptr + r[:, None] * K + kk[None, :], mask=km[None, :], other=0.0)
            acc += tl.sum(yv.to(tl.float32)[:, None, :] * wb.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _weights(w_ptr, K, n, nm, ONE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):  # fmt: skip
    """The [BLOCK_N, BLOCK_K] weights of output columns n when K fits one block (else a
    placeholder: `_gemv_part` loads them itself)."""
    kk = tl.arange(0, BLOCK_K)
    if ONE_BLOCK:
        w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=nm[:, None] & (kk[None, :] < K))
    else:
        w = tl.zeros([BLOCK_N, BLOCK_K], dtype=w_ptr.dtype.element_ty)
    return w


@triton.autotune(
    configs=_configs(),
    key=["K1", "K2", "N", "ROWS"],
    prune_configs_by={"early_config_prune": _prune},
    cache_results=True,  # tuned once per machine and shape: a new process reuses it
)
@triton.jit
def _linear_residual_kernel(
    x_ptr, out_ptr, N,
    y1_ptr, w1_ptr, b1_ptr, K1,
    y2_ptr, w2_ptr, b2_ptr, K2,
    ROWS: tl.constexpr, BIAS1: tl.constexpr, TWO: tl.constexpr, BIAS2: tl.constexpr,
    DTYPE: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_K2: tl.constexpr, ONE1: tl.constexpr,
    ONE2: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    r = tl.arange(0, ROWS)
    # The weights first; the activations (the previous kernels' outputs) after the wait.
    w1 = _weights(w1_ptr, K1, n, nm, ONE1, BLOCK_N, BLOCK_K1)
    if TWO:
        w2 = _weights(w2_ptr, K2, n, nm, ONE2, BLOCK_N, BLOCK_K2)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    a = _gemv_part(y1_ptr, K1, w1_ptr, n, nm, w1, ROWS, ONE1, BLOCK_N, BLOCK_K1)
    if BIAS1:
        a += tl.load(b1_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    x = tl.load(x_ptr + r[:, None] * N + n[None, :], mask=nm[None, :], other=0.0)
    out = _round(x.to(tl.float32) + _round(a, DTYPE), DTYPE)
    if TWO:
        m = _gemv_part(y2_ptr, K2, w2_ptr, n, nm, w2, ROWS, ONE2, BLOCK_N, BLOCK_K2)
        if BIAS2:
            m += tl.load(b2_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        out = _round(out + _round(m, DTYPE), DTYPE)
    tl.store(out_ptr + r[:, None] * N + n[None, :], out.to(DTYPE), mask=nm[None, :])


def linear_residual(
    x: torch.Tensor,
    y1: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    y2: torch.Tensor | None = None,
    w2: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """(x + (y1 @ w1.T + b1)) [+ (y2 @ w2.T + b2)] for rows x (R, N), each term and sum rounded
    as eager rounds them; a new tensor."""
    rows, N = x.shape
    _check_rows(rows)
    out = torch.empty_like(x)
    two = y2 is not None
    y2_, w2_ = (y2.contiguous(), w2) if two else (y1, w1)
    b1_ = b1 if b1 is not None else w1
    b2_ = b2 if b2 is not None else w2_
    K1, K2 = y1.shape[1], y2_.shape[1]
    block1, block2 = _block_k(K1, rows), _block_k(K2, rows)
    pdl = _pdl(x.device)

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]),)

    _linear_residual_kernel[grid](
        x.contiguous(), out, N,
        y1.contiguous(), w1, b1_, K1,
        y2_, w2_, b2_, K2,
        ROWS=rows, BIAS1=b1 is not None, TWO=two, BIAS2=two and b2 is not None,
        DTYPE=_tl_dtype(x.dtype), BLOCK_K1=block1, BLOCK_K2=block2, ONE1=block1 >= K1,
        ONE2=block2 >= K2, USE_PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return out


@triton.jit
def _rotate(
    base_ptr, d, cos_ptr, sin_ptr, p, ROT: tl.constexpr, HS: tl.constexpr, DTYPE: tl.constexpr
):
    """The head at base_ptr with its first ROT features rotated (rotate-half form, each product
    and the sum rounded as eager rounds them), fp32 holding model-dtype values."""
    dm = d < HS
    x = tl.load(base_ptr + d, mask=dm, other=0.0).to(tl.float32)
    if ROT > 0:
        rm = d < ROT
        half = ROT // 2
        partner = tl.where(d < half, d + half, d - half)
        other = tl.load(base_ptr + partner, mask=rm, other=0.0).to(tl.float32)
        other = tl.where(d < half, -other, other)
        cos = tl.load(cos_ptr + p * ROT + d, mask=rm, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + p * ROT + d, mask=rm, other=0.0).to(tl.float32)
        rotated = _round(_round(x * cos, DTYPE) + _round(other * sin, DTYPE), DTYPE)
        x = tl.where(rm, rotated, x)
    return x


@triton.jit
def _cache_block(k_cache, v_cache, valid_ptr, cache_row, b, S, s0, hi, slot, window, d, dm,
                 HS: tl.constexpr, WINDOWED: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """Keys and values of cached slots s0 .. s0 + BLOCK_S (below hi), and which of them the
    query sees: every load issued at once (the mask applies to the scores)."""
    s = s0 + tl.arange(0, BLOCK_S)
    inside = s < hi
    kv_off = (cache_row + s[:, None]) * HS + d[None, :]
    km = inside[:, None] & dm[None, :]
    k = tl.load(k_cache + kv_off, mask=km, other=0.0).to(tl.float32)
    v = tl.load(v_cache + kv_off, mask=km, other=0.0).to(tl.float32)
    seen = inside & (tl.load(valid_ptr + b * S + s, mask=inside, other=0) != 0)
    if WINDOWED:
        seen = seen & (slot - s <= window)
    return k, v, seen


@triton.jit
def _attend(q, k, v, seen, m, lsum, acc, scale):
    """The online softmax's update by one block of keys k and values v [BLOCK_S, HS]."""
    scores = tl.where(seen, tl.sum(k * q[None, :], axis=1) * scale, -float("inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    alpha = tl.exp(m - m_new)
    prob = tl.exp(scores - m_new)
    lsum = lsum * alpha + tl.sum(prob, axis=0)
    acc = acc * alpha + tl.sum(prob[:, None] * v, axis=0)
    return m_new, lsum, acc


@triton.jit
def _cached_attention_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, valid_ptr, k_cache, v_cache,
    pm_ptr, pl_ptr, pacc_ptr, count_ptr, out_ptr, S, chunk, scale, window,
    NH: tl.constexpr, NKV: tl.constexpr, HS: tl.constexpr, HS_PAD: tl.constexpr,
    ROT: tl.constexpr, WINDOWED: tl.constexpr, DTYPE: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    GRP: tl.constexpr = NH // NKV
    g = h // GRP
    d = tl.arange(0, HS_PAD)
    dm = d < HS
    p = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr)
    cache_row = (b * NKV + g) * S
    # Earlier slots from the cache, `chunk` of them per split (written by earlier steps: the
    # first block loads before the wait for the previous kernel); this step's own key from
    # registers, in split 0 (another program may not have stored it yet). Slots after this
    # one are never written yet.
    lo = split * chunk
    hi = tl.minimum(lo + chunk, slot)
    k, v, seen = _cache_block(
        k_cache, v_cache, valid_ptr, cache_row, b, S, lo, hi, slot, window, d, dm, HS,
        WINDOWED, BLOCK_S,
    )  # fmt: skip
    if USE_PDL:  # qkv is the previous kernel's output
        gdc_wait()
        gdc_launch_dependents()
    # The fused QKV row: per kv group, its GRP query heads, then its key, then its value.
    group = qkv_ptr + b * (NH + 2 * NKV) * HS + g * (GRP + 2) * HS
    q = _rotate(group + (h % GRP) * HS, d, cos_ptr, sin_ptr, p, ROT, HS, DTYPE)
    m = tl.full([1], -1e30, dtype=tl.float32)
    lsum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HS_PAD], dtype=tl.float32)
    m, lsum, acc = _attend(q, k, v, seen, m, lsum, acc, scale)
    for s0 in range(lo + BLOCK_S, hi, BLOCK_S):
        k, v, seen = _cache_block(
            k_cache, v_cache, valid_ptr, cache_row, b, S, s0, hi, slot, window, d, dm, HS,
            WINDOWED, BLOCK_S,
        )  # fmt: skip
        m, lsum, acc = _attend(q, k, v, seen, m, lsum, acc, scale)
    if split == 0:
        k_new = _rotate(group + GRP * HS, d, cos_ptr, sin_ptr, p, ROT, HS, DTYPE)
        v_new = tl.load(group + (GRP + 1) * HS + d, mask=dm, other=0.0).to(tl.float32)
        if h % GRP == 0:  # one program per kv head writes the cache
            tl.store(k_cache + (cache_row + slot) * HS + d, k_new.to(DTYPE), mask=dm)
            tl.store(v_cache + (cache_row + slot) * HS + d, v_new.to(DTYPE), mask=dm)
        own = tl.sum(q * k_new, axis=0) * scale
        m_new = tl.maximum(m, own)
        alpha = tl.exp(m - m_new)
        prob = tl.exp(own - m_new)
        lsum = lsum * alpha + prob
        acc = acc * alpha + prob * v_new
        m = m_new
    head = b * NH + h
    out = out_ptr + head * HS + d
    if SPLITS == 1:
        tl.store(out, _round(acc / lsum, DTYPE).to(DTYPE), mask=dm)
    else:
        one = tl.arange(0, 1)
        at = head * SPLITS + split
        tl.store(pm_ptr + at + one, m)
        tl.store(pl_ptr + at + one, lsum)
        tl.store(pacc_ptr + at * HS + d, acc, mask=dm)
        # The head's last split to finish (acq_rel: the others' partials are visible to it)
        # combines all of them and resets the counter for the next step.
        done = tl.atomic_add(count_ptr + head + one, 1)
        if tl.sum(done, axis=0) == SPLITS - 1:
            sp = tl.arange(0, SPLITS)
            ms = tl.load(pm_ptr + head * SPLITS + sp, cache_modifier=".cg")
            ls = tl.load(pl_ptr + head * SPLITS + sp, cache_modifier=".cg")
            accs = tl.load(
                pacc_ptr + (head * SPLITS + sp[:, None]) * HS + d[None, :],
                mask=dm[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            w = tl.exp(ms - tl.max(ms, axis=0))
            y = tl.sum(w[:, None] * accs, axis=0) / tl.sum(w * ls, axis=0)
            tl.store(out, _round(y, DTYPE).to(DTYPE), mask=dm)
            tl.store(count_ptr + head + one, tl.zeros([1], dtype=tl.int32))


MAX_SPLITS = 16
"""Splits of the cached slots per (row, head) in `cached_attention`: enough programs to fill a
GPU at batch 1 (16 heads x 16)."""


def attention_splits(slots: int, block: int = 64) -> tuple[int, int]:
    """(splits, slots per split) for a cache of `slots`: blocks of `block` slots, spread over
    at most MAX_SPLITS splits (a power of two)."""
    blocks = triton.cdiv(slots, block)
    splits = min(MAX_SPLITS, triton.next_power_of_2(blocks))
    return splits, triton.cdiv(blocks, splits) * block


class AttentionScratch:
    """`cached_attention`'s per-split partials and the counters of finished splits (kept at
    zero between steps by the kernel), for `rows` x `heads` at one cache length; one per
    decode session, reused by every layer."""

    def __init__(self, rows: int, heads: int, hs: int, slots: int, device) -> None:
        self.block = 64 if hs <= 64 else 32
        self.splits, self.chunk = attention_splits(slots, self.block)
        f32 = dict(dtype=torch.float32, device=device)
        self.m = torch.empty((rows, heads, self.splits), **f32)
        self.lsum = torch.empty((rows, heads, self.splits), **f32)
        self.acc = torch.empty((rows, heads, self.splits, hs), **f32)
        self.count = torch.zeros((rows, heads), dtype=torch.int32, device=device)


def cached_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    pos: torch.Tensor,
    slot: torch.Tensor,
    valid: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    scale: float,
    window: int | None = None,
    scratch: AttentionScratch | None = None,
) -> torch.Tensor:
    """Attention output (R, nh * hs) of one new token per row.

    qkv (R, (nh + 2 nkv) hs): the fused projection, not yet rotated; cos, sin (n, rot): the
    rotary tables in the model dtype (None: no rotary); pos (R,) or (R, 1): each row's position;
    slot (1,): the cache slot this step writes; valid (R, S): slots holding a real token (this
    step's included); k_cache, v_cache (R, nkv, S, hs), written at `slot`. window: a key at
    distance > window from the query is not seen (sliding-window layers). scratch: buffers
    from an earlier call of this shape (made here if None).
    """
    rows, nkv, S, hs = k_cache.shape
    _check_rows(rows)
    if scratch is None:
        scratch = AttentionScratch(rows, num_heads, hs, S, qkv.device)
    rot = 0 if cos is None else cos.shape[-1]
    cos_ = cos if cos is not None else qkv
    sin_ = sin if sin is not None else qkv
    out = qkv.new_empty((rows, num_heads * hs))
    pdl = _pdl(qkv.device)
    _cached_attention_kernel[(rows, num_heads, scratch.splits)](
        qkv, cos_, sin_, pos, slot, valid, k_cache, v_cache,
        scratch.m, scratch.lsum, scratch.acc, scratch.count, out,
        S, scratch.chunk, scale, window if window is not None else 0,
        NH=num_heads, NKV=nkv, HS=hs, HS_PAD=triton.next_power_of_2(hs), ROT=rot,
        WINDOWED=window is not None, DTYPE=_tl_dtype(qkv.dtype), BLOCK_S=scratch.block,
        SPLITS=scratch.splits, USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out


def _tl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[
        dtype
    ]


@triton.jit
def _greedy_kernel(
    logits_ptr, stride, vocab, part_val, part_idx, count_ptr,
    finished_ptr, tokens_ptr, chosen_ptr, tok_ptr, slot_ptr, S, eod,
    BLOCKS: tl.constexpr, BLOCKS_PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = tl.load(logits_ptr + b * stride + offs, mask=inside, other=-float("inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    first = tl.min(tl.where(inside & (x == best), offs, 2147483647), axis=0)
    one = tl.arange(0, 1)
    tl.store(part_val + b * BLOCKS + blk + one, tl.zeros([1], dtype=tl.float32) + best)
    tl.store(part_idx + b * BLOCKS + blk + one, tl.zeros([1], dtype=tl.int32) + first)
    # The row's last block to finish picks among the blocks' winners (the first of equal
    # maxima, as torch.argmax) and does the step's bookkeeping.
    done = tl.atomic_add(count_ptr + b + one, 1)
    if tl.sum(done, axis=0) == BLOCKS - 1:
        blocks = tl.arange(0, BLOCKS_PAD)
        bm = blocks < BLOCKS
        vals = tl.load(part_val + b * BLOCKS + blocks, mask=bm, other=-float("inf"),
                       cache_modifier=".cg")  # fmt: skip
        idxs = tl.load(part_idx + b * BLOCKS + blocks, mask=bm, other=2147483647,
                       cache_modifier=".cg")  # fmt: skip
        top = tl.max(vals, axis=0)
        choice = tl.min(tl.where(bm & (vals == top), idxs, 2147483647), axis=0).to(tl.int64)
        ended = tl.load(finished_ptr + b + one) != 0
        tok = tl.where(ended, eod, choice + tl.zeros([1], dtype=tl.int64))
        slot = tl.load(slot_ptr + one)
        tl.store(tokens_ptr + b * S + slot, tok)
        raw = tl.load(logits_ptr + b * stride + tok).to(tl.float32)
        tl.store(chosen_ptr + b * S + slot, raw)
        tl.store(finished_ptr + b + one, (ended | (tok == eod)).to(finished_ptr.dtype.element_ty))
        tl.store(tok_ptr + b + one, tok)
        tl.store(count_ptr + b + one, tl.zeros([1], dtype=tl.int32))


class GreedyScratch:
    """`greedy_choice`'s per-block winners and its counters (kept at zero by the kernel)."""

    BLOCK = 2048

    def __init__(self, rows: int, vocab: int, device) -> None:
        self.blocks = triton.cdiv(vocab, self.BLOCK)
        self.val = torch.empty((rows, self.blocks), dtype=torch.float32, device=device)
        self.idx = torch.empty((rows, self.blocks), dtype=torch.int32, device=device)
        self.count = torch.zeros(rows, dtype=torch.int32, device=device)


def greedy_choice(
    logits: torch.Tensor,
    vocab: int,
    eod: int,
    finished: torch.Tensor,
    tokens: torch.Tensor,
    chosen: torch.Tensor,
    tok: torch.Tensor,
    slot: torch.Tensor,
    scratch: GreedyScratch | None = None,
) -> None:
    """The greedy step's choice and bookkeeping in one kernel, as the Generator's `_choose`
    does them: per row the argmax of logits[:, :vocab] (the first of equal maxima), or `eod`
    for a row that has ended, written to tokens[:, slot] and tok, its raw logit to
    chosen[:, slot] (fp32), and finished |= (token == eod)."""
    rows = logits.shape[0]
    if scratch is None:
        scratch = GreedyScratch(rows, vocab, logits.device)
    _greedy_kernel[(rows, scratch.blocks)](
        logits, logits.stride(0), vocab, scratch.val, scratch.idx, scratch.count,
        finished, tokens, chosen, tok, slot, tokens.shape[1], eod,
        BLOCKS=scratch.blocks, BLOCKS_PAD=triton.next_power_of_2(scratch.blocks),
        BLOCK=scratch.BLOCK, num_warps=4,
    )  # fmt: skip
