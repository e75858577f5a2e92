"""The model's shape: the sizes a ModelConfig builds (head size, key/value heads, MLP width,
rotary dimensions, RoPE scaling, each layer's attention type), computed once when the config is
validated and carried as `ModelConfig.shape`. The functions here take plain values, so this
module needs no config class."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

# gpt-neox attention types neox runs; the sparse/linear/recurrent ones are refused by name.
SUPPORTED_ATTENTION = ("global", "flash", "local")
UNSUPPORTED_ATTENTION = {
    "sparse_fixed": "sparse attention",
    "sparse_variable": "sparse attention",
    "bigbird": "sparse attention",
    "bslongformer": "sparse attention",
    "gmlp": "gMLP",
    "amlp": "gMLP",
    "rwkv": "RWKV",
    "mamba": "Mamba layers",
}
GATED_ACTIVATIONS = ("swiglu", "geglu")


ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")
# rope_scaling mapping key (transformers' spelling) -> flat key.
ROPE_SCALING_KEYS = {
    "factor": "rope_scaling_factor",
    "original_max_position_embeddings": "rope_original_max_position_embeddings",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "beta_fast": "rope_yarn_beta_fast",
    "beta_slow": "rope_yarn_beta_slow",
    "attention_factor": "rope_yarn_attention_factor",
    "mscale": "rope_yarn_mscale",
    "mscale_all_dim": "rope_yarn_mscale_all_dim",
    "truncate": "rope_yarn_truncate",
}
# Flat keys each scaling type reads (the others must stay unset).
ROPE_TYPE_KEYS = {
    "linear": ("rope_scaling_factor",),
    "dynamic": ("rope_scaling_factor",),
    "llama3": (
        "rope_scaling_factor",
        "rope_original_max_position_embeddings",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
    ),
    "yarn": (
        "rope_scaling_factor",
        "rope_original_max_position_embeddings",
        "rope_yarn_beta_fast",
        "rope_yarn_beta_slow",
        "rope_yarn_attention_factor",
        "rope_yarn_mscale",
        "rope_yarn_mscale_all_dim",
        "rope_yarn_truncate",
    ),
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling with every default resolved as transformers resolves it."""

    rope_type: str  # linear | dynamic | yarn | llama3
    factor: float
    original_max_positions: int  # yarn/llama3: pretraining length; dynamic: max_positions
    low_freq_factor: float = 0.0  # llama3
    high_freq_factor: float = 0.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # scale of cos and sin (yarn)
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class ModelShape:
    """Sizes the model is built with, computed from a ModelConfig alone (so tools holding only a
    checkpoint's model config get the same numbers as the run that wrote it)."""

    head_dim: int
    kv_heads: int  # key/value heads (num_kv_heads, or one per query head)
    ffn_size: int  # MLP inner width, per branch for gated activations
    gated_mlp: bool
    rotary_dims: int  # dimensions of each head that rotary embeddings rotate
    max_positions: int  # longest sequence the model supports
    position_rows: int  # rows of the learned position table (OPT shifts ids by an offset)
    layer_types: tuple[str, ...]  # attention type of each layer
    attn_dense_bias: bool = True  # bias of the attention output projection
    rope: Optional[RopeScaling] = None  # RoPE scaling, None for plain rotary


def rope_scaling(
    flat: dict[str, Any],
    mapping: Optional[dict[str, Any]],
    base: int,
    pos_emb: str,
    max_positions: int,
) -> Optional[RopeScaling]:
    """The RoPE scaling the flat rope_* keys (`flat`, key -> value) or the rope_scaling `mapping`
    ask for; raises ValueError naming the key when a value is missing, misplaced or
    contradictory."""
    flat = dict(flat)
    flat["rope_yarn_truncate"] = None if flat["rope_yarn_truncate"] else False  # True: default
    if mapping is not None:
        if any(v is not None for v in flat.values()):
            given = ", ".join(f"{k}={v}" for k, v in flat.items() if v is not None)
            raise ValueError(f"rope_scaling={mapping} and {given} are both set; keep one spelling")
        flat = _flat_rope_keys(mapping, base)
    kind = flat["rope_scaling_type"]
    if kind is None:
        stray = [f"{k}={v}" for k, v in flat.items() if v is not None]
        if stray:
            raise ValueError(
                f"{', '.join(stray)} set without rope_scaling_type; set it or drop them"
            )
        return None
    if pos_emb != "rotary":
        raise ValueError(f"rope_scaling_type={kind!r} needs pos_emb=rotary (got {pos_emb!r})")
    stray = [
        f"{k}={v}"
        for k, v in flat.items()
        if v is not None and k not in ("rope_scaling_type", *ROPE_TYPE_KEYS[kind])
    ]
    if stray:
        raise ValueError(
            f"{', '.join(stray)} do not apply to rope_scaling_type={kind!r}; drop them"
        )
    factor = flat["rope_scaling_factor"]
    original = flat["rope_original_max_position_embeddings"] or max_positions
    if factor is None and kind == "yarn":
        factor = max_positions / original  # transformers' default for yarn
    if factor is None:
        raise ValueError(f"rope_scaling_type={kind!r} needs rope_scaling_factor (e.g. 8.0)")
    if kind == "dynamic":
        return RopeScaling(kind, float(factor), max_positions)
    if kind == "linear":
        return RopeScaling(kind, float(factor), original)
    if kind == "llama3":
        low, high = flat["rope_low_freq_factor"], flat["rope_high_freq_factor"]
        if low is None or high is None:
            raise ValueError(
                "rope_scaling_type='llama3' needs rope_low_freq_factor and rope_high_freq_factor "
                "(Llama 3.1: 1.0 and 4.0)"
            )
        if high <= low:
            raise ValueError(f"rope_high_freq_factor={high} must exceed rope_low_freq_factor={low}")
        return RopeScaling(kind, float(factor), original, float(low), float(high))
    attention = flat["rope_yarn_attention_factor"]
    mscale, mscale_all = flat["rope_yarn_mscale"], flat["rope_yarn_mscale_all_dim"]
    if attention is None:
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    return RopeScaling(
        kind,
        float(factor),
        original,
        beta_fast=float(flat["rope_yarn_beta_fast"] or 32),
        beta_slow=float(flat["rope_yarn_beta_slow"] or 1),
        attention_factor=float(attention),
        truncate=flat["rope_yarn_truncate"] is not False,
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term: 0.1 mscale ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _flat_rope_keys(mapping: dict, base: int) -> dict:
    """A transformers-style rope_scaling mapping as the flat rope_* keys (None where unset);
    raises ValueError quoting the mapping."""
    given, mapping = dict(mapping), dict(mapping)
    kind = mapping.pop("rope_type", mapping.pop("type", None))
    theta = mapping.pop("rope_theta", base)
    problem = None
    unknown = sorted(str(k) for k in mapping if k not in ROPE_SCALING_KEYS)
    if unknown:
        problem = (
            f"unknown key(s) {unknown}; it takes rope_type and {', '.join(ROPE_SCALING_KEYS)} "
            "(rotary_emb_base sets the base)"
        )
    elif theta != base:
        problem = f"rope_theta={theta} differs from rotary_emb_base={base}; drop rope_theta"
    elif kind not in (None, "default", *ROPE_TYPES):
        problem = f"rope_type={kind!r} is not supported; use one of {ROPE_TYPES}"
    for key, value in mapping.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if problem is None and key == "truncate" and not isinstance(value, bool):
            problem = f"truncate={value!r} must be true or false"
        elif problem is None and key != "truncate" and value is not None:
            may_be_zero = key in ("attention_factor", "mscale", "mscale_all_dim")
            if (
                not number
                or not math.isfinite(value)
                or value < 0
                or (value == 0 and not may_be_zero)
            ):
                problem = f"{key}={value!r} must be a finite number > 0"
    if problem:
        raise ValueError(f"rope_scaling={given}: {problem}")
    flat = {flat_key: mapping.get(key) for key, flat_key in ROPE_SCALING_KEYS.items()}
    if flat["rope_yarn_truncate"] is True:
        flat["rope_yarn_truncate"] = None  # the default, as the flat key's True
    return {"rope_scaling_type": None if kind == "default" else kind, **flat}


def ffn_size(
    hidden_size: int,
    intermediate_size: Optional[int],
    expansion_factor: Optional[float],
    activation: str,
    multiple_of: int,
) -> int:
    """Inner width of the MLP (per branch for gated activations), as gpt-neox derives it."""
    if intermediate_size is not None:
        width = intermediate_size
    elif expansion_factor is not None:
        width = int(expansion_factor * hidden_size)
    else:
        width = 4 * hidden_size
    if activation in GATED_ACTIVATIONS:
        # Equal parameters to the ungated MLP: two branches of 2/3 of the width, halved.
        width = int(width * 2 / 3) // 2
    k = multiple_of
    return k * ((width + k - 1) // k)


def layer_types(attention_config: Optional[list[Any]], num_layers: int) -> tuple[str, ...]:
    """Attention type of each layer, expanded from attention_config (default: all global)."""
    if not attention_config:
        return ("global",) * num_layers
    types: list[str] = []
    for entry in attention_config:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise ValueError(
                f"attention_config entry {entry!r} must be [[types...], repeat], "
                'e.g. [["flash"], 24]'
            )
        kinds, repeat = entry
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if repeat == "all":  # gpt-neox: the pattern repeats over every layer
            repeat = num_layers // max(1, len(kinds))
        if not isinstance(repeat, int):
            raise ValueError(f'attention_config repeat {repeat!r} must be a whole number or "all"')
        types.extend(kinds * repeat)
    for kind in types:
        if kind in UNSUPPORTED_ATTENTION:
            raise ValueError(
                f"attention type {kind!r} (attention_config) asks for "
                f"{UNSUPPORTED_ATTENTION[kind]}, which is not implemented in neox; "
                f"use one of {SUPPORTED_ATTENTION}"
            )
        if kind not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"unknown attention type {kind!r} in attention_config; use one of "
                f"{SUPPORTED_ATTENTION}"
            )
    if len(types) != num_layers:
        raise ValueError(
            f"attention_config describes {len(types)} layers but num_layers={num_layers}; "
            f"make the repeats add up to {num_layers}"
        )
    return tuple(types)


def refuse_local_without_window(shape: ModelShape, sliding_window_width: Optional[int]) -> None:
    """`local` layers attend within sliding_window_width; without one the model cannot be built
    (the dry run and tools/estimate.py printed a traceback)."""
    if "local" in shape.layer_types and sliding_window_width is None:
        raise ValueError(
            "attention_config has `local` layers but sliding_window_width is unset; set "
            "sliding_window_width (e.g. 4096) or use `global`/`flash` layers"
        )


def refuse_degenerate_shape(
    shape: ModelShape,
    *,
    pos_emb: str,
    rotary_pct: float,
    heads: int,
    hidden_size: int,
    intermediate_size: Optional[int],
    expansion_factor: float,
) -> None:
    """Sizes that round to nothing trained silently: rotary on 0 dimensions (no positions at
    all), an MLP 0 wide. Raises ValueError naming the smallest value that works."""
    if pos_emb == "rotary" and shape.rotary_dims == 0:
        if shape.head_dim < 2:
            raise ValueError(
                f"pos_emb=rotary: head_dim={shape.head_dim} has no pair of dimensions to rotate; "
                f"use at most half as many num_attention_heads={heads} as "
                f"hidden_size={hidden_size}, set head_dim >= 2, or use another pos_emb"
            )
        raise ValueError(
            f"rotary_pct={rotary_pct} rotates 0 of the {shape.head_dim} head dimensions (no "
            f"positions at all); the smallest is rotary_pct: {_at_least(2, shape.head_dim)}"
        )
    if shape.ffn_size == 0:
        # A gated MLP splits 2/3 of the width into two branches: it needs 3 to keep one unit.
        width = 3 if shape.gated_mlp else 1
        if intermediate_size is not None:
            fix = f"intermediate_size: {width}"
            given = f"intermediate_size={intermediate_size}"
        else:
            fix = f"expansion_factor: {_at_least(width, hidden_size)}"
            given = f"expansion_factor={expansion_factor} x hidden_size={hidden_size}"
        raise ValueError(f"{given} gives an MLP 0 units wide; the smallest is {fix}")


def _at_least(units: int, per_one: int) -> float:
    """The smallest x of three significant digits with int(x * per_one) >= units."""
    step = 10.0 ** (math.floor(math.log10(units / per_one)) - 2)
    k = math.ceil(units / per_one / step)
    while int(float(f"{k * step:.3g}") * per_one) < units:
        k += 1
    return float(f"{k * step:.3g}")
