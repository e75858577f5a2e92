"""Layout-independent initialisation: each parameter is a function of (its name, seed) alone.

A tensor-parallel rank calls init_parameter for the full shape and keeps its slice, so a model
starts from the same numbers whatever the parallel layout. Methods follow gpt-neox's
megatron/model/init_functions.py: init_method for weights reading the residual stream,
output_layer_init_method for those writing into it, zero biases, unit norm weights.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from neox.config.model import ModelConfig

# Weights whose output is added to the residual stream (megatron's output_layer_init_method).
OUTPUT_LAYER_SUFFIXES = (
    "attention.dense.weight",
    "mlp.dense_4h_to_h.weight",
    "mlp.experts.dense_4h_to_h",
    "mlp.shared_experts.dense_4h_to_h.weight",
)


def parameter_seed(name: str, seed: int) -> int:
    """A stable 63-bit seed from the run seed and the parameter name (hash() varies per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_parameter(name: str, shape: Sequence[int], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The initial float32 CPU value of parameter `name` (fully qualified) of the full `shape`."""
    shape = tuple(shape)
    if len(shape) == 1:
        # Biases start at zero; norm gains (layernorm, rmsnorm, scalenorm weight) at one.
        return torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)
    method = cfg.init_method
    if name.endswith(OUTPUT_LAYER_SUFFIXES):
        method = cfg.output_layer_init_method
    if len(shape) == 3:
        # Stacked experts (E, out, in): each expert its own matrix and seed, so an expert-parallel
        # rank can initialise its own slice alone.
        return torch.stack(
            [_matrix(f"{name}.{e}", shape[1:], method, cfg, seed) for e in range(shape[0])]
        )
    return _matrix(name, shape, method, cfg, seed)


def _matrix(
    name: str, shape: Sequence[int], method: str, cfg: ModelConfig, seed: int
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(parameter_seed(name, seed))
    return _fill(torch.empty(shape), method, cfg, generator)


def _fill(t: torch.Tensor, method: str, cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    std = cfg.init_method_std
    layers, hidden = cfg.num_layers, cfg.hidden_size
    normal_std = {
        "normal": std,
        "scaled_normal": std / math.sqrt(2 * layers),
        # One residual branch per layer (gpt-neox's Mamba variant).
        "single_residual_scaled_normal": std / math.sqrt(layers),
        "small_init": math.sqrt(2 / (5 * hidden)),
        "wang_init": 2 / layers / math.sqrt(hidden),
    }
    if method in normal_std:
        return torch.nn.init.normal_(t, 0.0, normal_std[method], generator=g)
    if method == "xavier_uniform":
        return torch.nn.init.xavier_uniform_(t, generator=g)
    if method == "xavier_normal":
        return torch.nn.init.xavier_normal_(t, generator=g)
    if method in ("orthogonal", "scaled_orthogonal"):
        # gpt-neox's gain sqrt(2 / n_layers), with n_layers = 1 for the unscaled variant.
        n = layers if method == "scaled_orthogonal" else 1
        return torch.nn.init.orthogonal_(t, gain=math.sqrt(2 / n), generator=g)
    raise ValueError(f"unknown init method {method!r}")
