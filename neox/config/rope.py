"""RoPE scaling keys of the model group (longer contexts than a model was pretrained at), as
transformers' rope_parameters computes them; neox/config/shape.py turns them into the model's
rotary scaling."""

from typing import Annotated, Any, Literal, Optional

from pydantic import Field

from neox.config.base import MAX_POSITIONS, ConfigGroup, Reads


class RopeScalingFields(ConfigGroup):
    """How rotary frequencies are scaled past the pretraining context."""

    rope_scaling_type: Annotated[
        Optional[Literal["linear", "dynamic", "yarn", "llama3"]], Reads("neox/config/shape.py")
    ] = None
    """RoPE scaling as transformers' `rope_parameters.rope_type` computes it: `linear` divides
    every frequency by the factor; `dynamic` (NTK) raises the base once a sequence is longer than
    max_position_embeddings, recomputed from each forward's largest position; `yarn` blends
    interpolated and original frequencies and scales cos/sin by its attention factor; `llama3`
    divides the low frequencies by the factor, smoothly (Llama 3.1+). None: unscaled."""

    rope_scaling_factor: Annotated[Optional[float], Reads("neox/config/shape.py")] = Field(
        None, gt=0, le=1e6
    )
    """The scaling `factor` (required by every rope_scaling_type; for yarn, None means
    max_position_embeddings / rope_original_max_position_embeddings, as transformers does)."""

    rope_original_max_position_embeddings: Annotated[
        Optional[int], Reads("neox/config/shape.py")
    ] = Field(None, ge=1, le=MAX_POSITIONS)
    """Pretraining context length of a `yarn` or `llama3` model (None: max_position_embeddings);
    `dynamic` scales from max_position_embeddings itself, as transformers does."""

    rope_low_freq_factor: Annotated[Optional[float], Reads("neox/config/shape.py")] = Field(
        None, gt=0, le=1e6
    )
    """`llama3`: wavelengths longer than original length / this are divided by the factor
    (Llama 3.1: 1)."""

    rope_high_freq_factor: Annotated[Optional[float], Reads("neox/config/shape.py")] = Field(
        None, gt=0, le=1e6
    )
    """`llama3`: wavelengths shorter than original length / this are kept; those between the two
    bounds are interpolated (Llama 3.1: 4)."""

    rope_yarn_beta_fast: Annotated[Optional[float], Reads("neox/config/shape.py")] = Field(
        None, gt=0, le=1e6
    )
    """`yarn`: rotations bounding the extrapolated (unscaled) dimensions (None: 32)."""

    rope_yarn_beta_slow: Annotated[Optional[float], Reads("neox/config/shape.py")] = Field(
        None, gt=0, le=1e6
    )
    """`yarn`: rotations bounding the interpolated dimensions (None: 1)."""

    rope_yarn_attention_factor: Annotated[Optional[float], Reads("neox/config/shape.py")] = Field(
        None, ge=0, le=1e6
    )
    """`yarn`: scale of cos and sin (None: 0.1 ln(factor) + 1, or the mscale ratio below)."""

    rope_yarn_mscale: Annotated[Optional[float], Reads("neox/config/shape.py")] = Field(
        None, ge=0, le=1e6
    )
    """`yarn`, with rope_yarn_mscale_all_dim and no attention factor: the attention factor is
    (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1) (DeepSeek-style)."""

    rope_yarn_mscale_all_dim: Annotated[Optional[float], Reads("neox/config/shape.py")] = Field(
        None, ge=0, le=1e6
    )
    """`yarn`: the denominator's mscale of the attention factor (see rope_yarn_mscale)."""

    rope_yarn_truncate: Annotated[bool, Reads("neox/config/shape.py")] = True
    """`yarn`: round the correction range's bounds to whole dimensions (transformers' default;
    gpt-oss sets false)."""

    rope_scaling: Annotated[Optional[dict[str, Any]], Reads("neox/config/model.py")] = None
    """The same settings as one mapping in transformers' spelling, e.g. {rope_type: llama3,
    factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings:
    8192}; an alternative to the flat rope_* keys (not both)."""
