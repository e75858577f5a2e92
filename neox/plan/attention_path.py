"""Which attention kernel each layer type runs, and why: one decision that the model
(neox/model/attention.py), the memory estimate and ``deepy.py --dry-run`` all read.

Torch-free (the model package imports torch), so a dry run answers without it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from neox.config.model import ModelConfig

# What each attention_impl value runs, in words.
IMPL_NAMES = {
    "flash": "torch SDPA (flash)",
    "flex": "FlexAttention (block-sparse)",
    "triton": "Triton fused softmax",
    "torch": "unfused torch softmax",
}

# Why auto prefers SDPA's flash kernel to the Triton softmax the fusion flags name.
_SAME_MATH = (
    "SDPA flash runs the same scale + causal mask + softmax (float32 softmax statistics) fused "
    "with both matmuls, 1.9x the Triton path's tokens/s at 410M (docs/benchmarks.md); "
    "attention_impl: triton still selects the Triton softmax"
)


# Which kernel torch's SDPA dispatch takes for the plain causal call (measured, one H200, torch
# 2.11: the default ran cuDNN's kernels at seq 2k, 8k and 32k; docs/benchmarks.md).
_CUDNN = (
    "on H100/H200 torch dispatches it to cuDNN's fused attention, 1.45-1.72x its flash kernel "
    "at seq 2k-32k"
)


@dataclass(frozen=True)
class AttentionPath:
    """The kernel one layer type runs (an ``attention_impl`` value, never "auto") and why."""

    impl: str
    reason: str

    def __str__(self) -> str:
        return f"{IMPL_NAMES[self.impl]} (why: {self.reason})"


def _fusion_flags(cfg: ModelConfig) -> list[str]:
    flags = ("scaled_upper_triang_masked_softmax_fusion", "scaled_masked_softmax_fusion")
    return [flag for flag in flags if getattr(cfg, flag)]


def _flex_refusal(cfg: ModelConfig) -> Optional[str]:
    """Why FlexAttention cannot run this model's attention exactly, or None."""
    if cfg.attention_dropout > 0:
        return f"attention_dropout={cfg.attention_dropout}"
    return None


def select_attention_path(
    cfg: ModelConfig, layer_type: str, device: object = "cuda", packed: bool = False
) -> AttentionPath:
    """The kernel of a `layer_type` layer on `device` ("cuda", "cpu" or a torch.device), with
    `packed` documents (reset_attention_mask: attention within each document) or not.

    attention_impl other than "auto" is obeyed (flex needs CUDA: FlexAttention has no CPU
    backward, so CPU ranks take SDPA with the dense mask). "auto" is exact everywhere and on
    CUDA picks the fastest kernel: FlexAttention where a mask or bias would rule out SDPA's
    flash kernel (sliding windows, packed documents, ALiBi), SDPA flash otherwise, also where
    gpt-neox's fusion flags ask for a fused softmax (the same math, fused further). Attention
    dropout keeps SDPA with an explicit mask (FlexAttention has none). (Decoding with a KV cache always takes SDPA: only
    its explicit mask fits Sq < Sk.)
    """
    device_type = getattr(device, "type", str(device).split(":")[0])
    # layer_window's check (a `local` layer needs a width) is the model's and the dry run's.
    local = "local" in cfg.shape.layer_types
    window = cfg.sliding_window_width if layer_type == "local" or not local else None
    no_flex = _flex_refusal(cfg)
    if cfg.attention_impl == "flex":
        if no_flex:
            raise ValueError(
                f"attention_impl: flex cannot run {no_flex} (FlexAttention has no dropout); "
                "use attention_impl: auto or flash"
            )
        if device_type != "cuda":
            return AttentionPath("flash", "attention_impl: flex, not on CUDA (no CPU backward)")
    if cfg.attention_impl != "auto":
        return AttentionPath(cfg.attention_impl, f"attention_impl: {cfg.attention_impl}")
    masked = [f"sliding window {window}"] if window is not None else []
    masked += ["packed documents (reset_attention_mask)"] if packed else []
    # ALiBi as a dense bias would rule out SDPA's flash kernel; FlexAttention adds it per tile.
    masked += ["ALiBi"] if cfg.pos_emb == "alibi" else []
    if device_type != "cuda":
        return AttentionPath("flash", "attention_impl auto, not on CUDA")
    if masked and not no_flex:
        return AttentionPath(
            "flex", f"attention_impl auto, {' + '.join(masked)}: skips the masked tiles"
        )
    if masked:
        return AttentionPath("flash", f"attention_impl auto, {' + '.join(masked)} with {no_flex}")
    flags = _fusion_flags(cfg)
    if flags:
        return AttentionPath(
            "flash",
            f"attention_impl auto, `{layer_type}` layers + {' + '.join(flags)}: {_SAME_MATH}",
        )
    return AttentionPath("flash", f"attention_impl auto, `{layer_type}` layers, causal; {_CUDNN}")


def layer_window(cfg: ModelConfig, layer_type: str) -> Optional[int]:
    """Sliding-window width of a layer, or None for full causal attention.

    When attention_config names `local` layers, only those are windowed; otherwise
    sliding_window_width applies to every layer (Mistral-style).
    """
    if "local" in cfg.shape.layer_types:
        if layer_type != "local":
            return None
        if cfg.sliding_window_width is None:
            raise ValueError(
                "attention_config has `local` layers but sliding_window_width is unset; "
                "set sliding_window_width (e.g. 4096) or use `global`/`flash` layers"
            )
    return cfg.sliding_window_width


def context_parallel_path(
    cfg: ModelConfig, tp: int = 1, cp: int = 1, chunks: int = 1
) -> Optional[str]:
    """How attention runs when each sequence is split over `cp` ranks (None at cp = 1): the
    collective around the kernel, in `chunks` head groups (context_parallel_chunks), and the
    heads each rank attends with over the whole sequence (neox/parallel/context.py)."""
    if cp == 1:
        return None
    heads, kv = cfg.num_attention_heads // tp, cfg.shape.kv_heads // tp
    kv_note = f"{kv // cp} kv heads"
    if kv % cp:
        kv_note = f"{heads // cp} kv heads (the {kv} kv heads replicated, one per query head)"
    line = (
        f"context parallel over {cp} ranks: Ulysses all-to-all of q, k, v before the kernel and "
        f"of its output after it, over the context-parallel group; each rank attends with "
        f"{heads // cp} query heads and {kv_note} over the whole sequence"
    )
    if chunks > 1:
        group = heads // cp // chunks
        line += (
            f"; the exchange in {chunks} groups of {group} query head{'s' * (group > 1)}, each "
            f"group's kernel between its own q, k, v transfer and its output's"
        )
    return line


def describe_attention_paths(
    cfg: ModelConfig,
    cpu_ranks: bool = False,
    packed: bool = False,
    tp: int = 1,
    cp: int = 1,
    chunks: int = 1,
) -> list[str]:
    """One line per layer type, in order of first appearance: count, kernel on GPU ranks, why,
    what else the layer adds (window, ALiBi), the CPU kernel if `cpu_ranks` and it differs, and
    under context parallelism (`cp` ranks, `tp` tensor-parallel, `chunks` head groups) its
    collective.
    `packed`: documents are packed with reset_attention_mask."""
    lines = []
    exchange = context_parallel_path(cfg, tp, cp, chunks)
    for layer_type, count in Counter(cfg.shape.layer_types).items():
        path = select_attention_path(cfg, layer_type, "cuda", packed)
        extras = []
        window = layer_window(cfg, layer_type)
        if window is not None:
            extras.append(f"sliding window {window}")
        if packed:
            extras.append("attends within each packed document")
        if cfg.pos_emb == "alibi":
            extras.append("ALiBi bias")
        if extras and path.impl == "flash":
            # An explicit mask rules out SDPA's flash kernel; torch picks efficient or math.
            extras.append("SDPA gets an explicit mask, so not its flash kernel")
        on_cpu = select_attention_path(cfg, layer_type, "cpu", packed)
        if cpu_ranks and on_cpu != path:
            needs = "Triton" if path.impl == "triton" else "this kernel"
            extras.append(f"on these CPU ranks: {IMPL_NAMES[on_cpu.impl]}, {needs} needs CUDA")
        if exchange:
            extras.append(exchange)
        note = f"; {'; '.join(extras)}" if extras else ""
        lines.append(f"{layer_type} x{count}: {path}{note}")
    return lines
