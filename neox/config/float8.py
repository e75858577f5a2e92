"""FP8 training: which linears compute in float8 (torchao), and gpt-neox's Transformer Engine
keys, mapped onto it where their meaning carries over and refused by name where it does not."""

from typing import Annotated, Literal, Optional

from pydantic import Field, model_validator

from neox.config.base import MAX_LAYERS, ConfigGroup, Reads, Refused, Restricted
from neox.config.errors import ConfigError

# The block linears FP8 can take (names as in neox/model, HF GPTNeoX's).
FP8_MODULES = (
    "attention.query_key_value",
    "attention.dense",
    "mlp.dense_h_to_4h",
    "mlp.gate",
    "mlp.dense_4h_to_h",
)


class Float8Spec(ConfigGroup):
    """The `fp8` section: {enabled: true, recipe: tensorwise}."""

    enabled: bool = False
    """Train the chosen block linears with float8 matmuls (torchao.float8); needs a GPU of
    compute capability 8.9 or newer (H100, H200, L40S, RTX 4090)."""

    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao's scaling recipe: one dynamic scale per tensor (fastest), or per row (more
    accurate, slower). Both scale from the current amax (no history)."""

    modules: list[Literal[FP8_MODULES]] = list(FP8_MODULES)  # type: ignore[valid-type]
    """The block linears converted (names under each layer). The embedding always stays in
    bf16, the output layer unless output_layer is set."""

    output_layer: bool = False
    """Compute the output layer (the vocabulary projection, tied or not) in float8 too. Off
    by default: the logits' matmul is where float8's rounding costs most. It is one block's
    matmuls or less (6 x hidden x vocab FLOPs a token), so it weighs most in shallow models
    (docs/benchmarks.md)."""

    skip_first_layers: int = Field(1, ge=0, le=MAX_LAYERS)
    """Blocks at the bottom kept in bf16 (the first block sees the raw embeddings)."""

    skip_last_layers: int = Field(1, ge=0, le=MAX_LAYERS)
    """Blocks at the top kept in bf16 (the last block feeds the logits)."""

    format: Optional[Literal["hybrid", "e4m3"]] = None
    """Float8 formats: hybrid (e4m3 forward, e5m2 gradients) or e4m3 throughout; None: the
    recipe's own (tensorwise hybrid, rowwise e4m3), or te_fp8_format when set."""

    wgrad: Optional[bool] = None
    """Whether the weight-gradient matmul runs in float8 too (false: in bf16, more accurate);
    None: te_fp8_wgrad, else true."""

    fast_accum_backward: bool = False
    """Accumulate the backward float8 matmuls (input and weight gradients) in the tensor
    cores' fast mode, as the forward matmul always does (torchao's default keeps the
    gradients' accumulation precise, as Transformer Engine does). Faster, less accurate
    gradients; measured in docs/benchmarks.md."""

    @model_validator(mode="after")
    def _some_module(self) -> "Float8Spec":
        if self.enabled and not self.modules:
            raise ValueError(
                f"fp8.modules is empty: nothing would run in float8; name some of {FP8_MODULES} "
                "or set fp8.enabled: false"
            )
        return self


_TE_MODULE = (
    "{key}={value!r} asks for Transformer Engine's {feature}, which neox does not use; FP8 "
    "training runs through torchao: remove {key} and set fp8: {{enabled: true}}"
)


def _te_module(what: str) -> Refused:
    """The refusal of gpt-neox's key for a Transformer Engine module neox does not use."""
    return Refused(
        feature=f"Transformer Engine's {what}",
        example=True,
        message=_TE_MODULE.replace("{feature}", what),
    )


class Float8Config(ConfigGroup):
    """FP8 training (torchao float8) and gpt-neox's te_* keys."""

    fp8: Annotated[
        Float8Spec,
        Reads("neox/config/float8.py", "neox/plan/preflight.py"),
        Restricted(
            "Enabled, not with fp16 nor pipe_parallel_size > 1; its output_layer not with "
            "lm_loss_chunk_size.",
            example={"fp8": {"enabled": True, "output_layer": True}, "bf16": {"enabled": True}},
            broken_by=(
                {"pipe_parallel_size": 2, "gradient_clipping": 0},
                {"lm_loss_chunk_size": 1024},
            ),
        ),
    ] = Float8Spec()
    """FP8 section: enabled, recipe (tensorwise | rowwise), modules, output_layer,
    skip_first_layers, skip_last_layers, format, wgrad, fast_accum_backward. Weights, optimizer states and checkpoints stay in the run's
    precision; only the chosen matmuls compute in float8."""

    te_fp8_format: Annotated[
        Optional[Literal["hybrid", "e4m3"]], Reads("neox/config/float8.py")
    ] = None
    """gpt-neox's Transformer Engine format: hybrid (e4m3 forward, e5m2 backward) or e4m3;
    sets fp8.format when the section leaves it out."""

    te_fp8_wgrad: Annotated[Optional[bool], Reads("neox/config/float8.py")] = None
    """gpt-neox's Transformer Engine key: false computes the weight gradient in high precision;
    sets fp8.wgrad when the section leaves it out."""

    te_fp8_amax_history_len: Annotated[
        Optional[int],
        Refused(
            feature="Transformer Engine's delayed scaling",
            example=16,
            allowed=(None, 1),
            message=(
                "{key}={value} asks for Transformer Engine's delayed scaling over an amax "
                "history; torchao's float8 scales each tensor by its current amax (a history "
                "of 1): set {key}: 1 or remove it"
            ),
        ),
    ] = None
    """gpt-neox's Transformer Engine key: only 1 (scale by the current amax) carries over."""

    te_fp8_amax_compute_algo: Optional[Literal["most_recent", "max"]] = None
    """No-op (gpt-neox's Transformer Engine key): over an amax history of one, `max` and
    `most_recent` are the same amax, which torchao scales by."""

    te_fp8_margin: Annotated[
        Optional[int],
        Refused(
            feature="Transformer Engine's scaling margin",
            example=2,
            allowed=(None, 0),
            message=(
                "{key}={value} asks for Transformer Engine's scaling margin (scale by "
                "2^-margin); torchao scales to the full float8 range: set {key}: 0 or remove it"
            ),
        ),
    ] = None
    """gpt-neox's Transformer Engine key: only 0 (no margin) carries over."""

    te_fp8_mha: Annotated[
        Optional[bool],
        Refused(
            feature="FP8 dot-product attention",
            example=True,
            allowed=(None, False),
            message=(
                "{key}={value!r} asks for FP8 dot-product attention (Transformer Engine), "
                "which neox does not implement; attention runs in bf16: remove {key}"
            ),
        ),
    ] = None
    """gpt-neox's Transformer Engine key (FP8 attention): not implemented, must be false."""

    te_columnparallel: Annotated[
        bool,
        _te_module("column-parallel linear"),
    ] = False
    """gpt-neox key (Transformer Engine's linear): not used; fp8 converts neox's own."""

    te_rowparallel: Annotated[
        bool,
        _te_module("row-parallel linear"),
    ] = False
    """gpt-neox key (Transformer Engine's linear): not used; fp8 converts neox's own."""

    te_layernorm_mlp: Annotated[
        bool,
        _te_module("fused LayerNorm-MLP"),
    ] = False
    """gpt-neox key (Transformer Engine's fused LayerNorm-MLP): not used."""

    te_mha: Annotated[
        bool,
        _te_module("attention"),
    ] = False
    """gpt-neox key (Transformer Engine's attention): not used; neox's attention runs."""

    def resolved(self) -> Optional[Float8Spec]:
        """The fp8 section with the te_* keys folded in where it leaves them out; None when
        FP8 is off. A te_* key that contradicts the section is an error."""
        spec = self.fp8
        if not spec.enabled:
            return None
        update = {}
        for own, te in (("format", "te_fp8_format"), ("wgrad", "te_fp8_wgrad")):
            te_value = getattr(self, te)
            if te_value is None:
                continue
            if getattr(spec, own) is not None and getattr(spec, own) != te_value:
                raise ValueError(
                    f"fp8.{own}={getattr(spec, own)!r} contradicts {te}={te_value!r}; "
                    f"remove {te} or make the two agree"
                )
            update[own] = te_value
        spec = spec.model_copy(update=update) if update else spec
        if spec.wgrad is None:
            spec = spec.model_copy(update={"wgrad": True})
        return spec

    @model_validator(mode="after")
    def _consistent(self) -> "Float8Config":
        self.resolved()
        return self

    def check_run(self, precision: str, pp: int, lm_loss_chunk_size: int) -> None:
        """FP8 (neox/model/transforms/float8.py) converts the plain model's linears: bf16 or fp32 master
        precision, no pipeline (its stages are built apart, neox/parallel/pipeline.py), and the
        output layer only where the model's own head computes the logits (no chunked loss).
        Run by `derive`."""
        if not self.fp8.enabled:
            return
        if precision == "fp16":
            raise ConfigError(
                "fp8.enabled with fp16: torchao's float8 training runs beside bf16 or fp32, not "
                "fp16 loss scaling; set bf16: {enabled: true} (precision: bfloat16)"
            )
        if pp > 1:
            raise ConfigError(
                f"fp8.enabled with pipe_parallel_size={pp}: FP8 is applied to the "
                "plain model, not to pipeline stages; use pipe_parallel_size 1 (tensor or data "
                "parallelism) or set fp8.enabled: false"
            )
        chunk = lm_loss_chunk_size
        if self.fp8.output_layer and chunk:
            raise ConfigError(
                f"fp8.output_layer with lm_loss_chunk_size={chunk}: the chunked loss computes the "
                "output layer in its own bf16 matmul; set lm_loss_chunk_size: 0 or "
                "fp8.output_layer: false"
            )
