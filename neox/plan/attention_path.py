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
    "triton": "Triton fused softmax",
    "torch": "unfused torch softmax",
}


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


def select_attention_path(
    cfg: ModelConfig, layer_type: str, device: object = "cuda"
) -> AttentionPath:
    """The kernel of a `layer_type` layer on `device` ("cuda", "cpu" or a torch.device).

    attention_impl other than "auto" is obeyed everywhere. "auto" gives CUDA `global` layers
    the Triton kernel when a gpt-neox fusion flag asks for a fused softmax, and SDPA otherwise.
    (Decoding with a KV cache always takes SDPA: only its explicit mask fits Sq < Sk.)
    """
    device_type = getattr(device, "type", str(device).split(":")[0])
    if cfg.attention_impl != "auto":
        return AttentionPath(cfg.attention_impl, f"attention_impl: {cfg.attention_impl}")
    flags = _fusion_flags(cfg)
    if layer_type != "global":
        return AttentionPath("flash", f"attention_impl auto, `{layer_type}` layers take SDPA")
    if not flags:
        return AttentionPath(
            "flash", "attention_impl auto, `global` layers, no softmax fusion flag"
        )
    if device_type != "cuda":
        return AttentionPath("flash", f"attention_impl auto, {' + '.join(flags)}, not on CUDA")
    return AttentionPath("triton", f"attention_impl auto, `global` layers + {' + '.join(flags)}")


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


def describe_attention_paths(cfg: ModelConfig, cpu_ranks: bool = False) -> list[str]:
    """One line per layer type, in order of first appearance: count, kernel on GPU ranks, why,
    what else the layer adds (window, ALiBi), and the CPU kernel if `cpu_ranks` and it differs."""
    lines = []
    for layer_type, count in Counter(cfg.shape.layer_types).items():
        path = select_attention_path(cfg, layer_type, "cuda")
        extras = []
        window = layer_window(cfg, layer_type)
        if window is not None:
            extras.append(f"sliding window {window}")
        if cfg.pos_emb == "alibi":
            extras.append("ALiBi bias")
        if extras and path.impl == "flash":
            # An explicit mask rules out SDPA's flash kernel; torch picks efficient or math.
            extras.append("SDPA gets an explicit mask, so not its flash kernel")
        on_cpu = select_attention_path(cfg, layer_type, "cpu")
        if cpu_ranks and on_cpu != path:
            extras.append(f"on these CPU ranks: {IMPL_NAMES[on_cpu.impl]}, Triton needs CUDA")
        note = f"; {'; '.join(extras)}" if extras else ""
        lines.append(f"{layer_type} x{count}: {path}{note}")
    return lines
