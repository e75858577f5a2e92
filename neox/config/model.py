"""Model architecture settings: the GPT-NeoX family (Pythia, GPT-NeoX-20B, Llama/Mistral-style)."""

from typing import Annotated, Any, Literal, Optional

from pydantic import Field, PrivateAttr, model_validator

from neox.config.base import (
    MAX_COUNT,
    MAX_LAYERS,
    MAX_MLP_WIDTH,
    MAX_POSITIONS,
    MAX_WIDTH,
    Reads,
    Refused,
    Restricted,
)
from neox.config.errors import ConfigError
from neox.config.moe import MoeFields
from neox.config.rope import RopeScalingFields
from neox.config.shape import (
    GATED_ACTIVATIONS,
    ROPE_SCALING_KEYS,
    ModelShape,
    ffn_size,
    layer_types,
    refuse_degenerate_shape,
    refuse_local_without_window,
    rope_scaling,
)

InitMethod = Literal[
    "normal",
    "scaled_normal",
    "orthogonal",
    "scaled_orthogonal",
    "xavier_uniform",
    "xavier_normal",
    "wang_init",
    "small_init",
    "single_residual_scaled_normal",
]


class ModelConfig(MoeFields, RopeScalingFields):
    """Shape and options of the decoder (the MoE keys in neox/config/moe.py)."""

    num_layers: Annotated[int, Reads("neox/model/init.py", "neox/config/model.py")] = Field(
        2, ge=1, le=MAX_LAYERS
    )
    """Number of transformer blocks."""

    hidden_size: Annotated[int, Reads("neox/model/gpt.py", "neox/model/attention.py")] = Field(
        64, ge=1, le=MAX_WIDTH
    )
    """Width of the residual stream."""

    num_attention_heads: Annotated[int, Reads("neox/model/attention.py")] = Field(
        4, ge=1, le=MAX_WIDTH
    )
    """Query heads per layer; hidden_size must be divisible by it."""

    num_kv_heads: Annotated[Optional[int], Reads("neox/config/model.py")] = Field(
        None, ge=1, le=MAX_WIDTH
    )
    """Key/value heads for grouped-query attention (None: same as num_attention_heads)."""

    intermediate_size: Annotated[Optional[int], Reads("neox/config/model.py")] = Field(
        None, ge=1, le=MAX_MLP_WIDTH
    )
    """MLP width before gating (None: 4 x hidden); gated MLPs use 2/3 of it per branch, as gpt-neox."""

    mlp_multiple_of: Annotated[int, Reads("neox/config/model.py")] = Field(
        1, ge=1, le=MAX_MLP_WIDTH
    )
    """Round the MLP inner width up to a multiple of this (Llama configs use 256)."""

    expansion_factor: Annotated[Optional[float], Reads("neox/config/model.py")] = Field(
        None, gt=0, le=64
    )
    """MLP width as a multiple of hidden_size, used when intermediate_size is unset."""

    seq_length: Annotated[int, Reads("neox/data/loader.py")] = Field(128, ge=1, le=MAX_POSITIONS)
    """Training sequence length in tokens."""

    max_position_embeddings: Annotated[Optional[int], Reads("neox/config/model.py")] = Field(
        None, ge=1, le=MAX_POSITIONS
    )
    """Longest position the model supports (None: seq_length); seq_length may not exceed it."""

    sliding_window_width: Annotated[Optional[int], Reads("neox/plan/attention_path.py")] = Field(
        None, ge=1, le=MAX_POSITIONS
    )
    """Local attention as gpt-neox's flash-attn window: a query sees the keys at distance <= N,
    itself included, so N + 1 keys (HF Mistral/Qwen `sliding_window` = N + 1); None is full
    causal. Every layer, or only the `local` layers of attention_config."""

    head_dim: Annotated[Optional[int], Reads("neox/config/model.py")] = Field(
        None, ge=1, le=MAX_WIDTH
    )
    """Features per attention head (None: hidden_size / num_attention_heads). Qwen3-0.6B uses
    128 with hidden_size 1024 and 16 heads; the query projection is then heads x head_dim wide."""

    norm: Annotated[Literal["layernorm", "rmsnorm", "scalenorm"], Reads("neox/model/norms.py")] = (
        "layernorm"
    )
    """Normalisation layer."""

    layernorm_epsilon: Annotated[float, Reads("neox/model/norms.py")] = Field(1.0e-5, gt=0, le=1)
    """Epsilon of layernorm."""

    rms_norm_epsilon: Annotated[float, Reads("neox/model/norms.py")] = Field(1.0e-8, gt=0, le=1)
    """Epsilon of rmsnorm (gpt-neox default; Llama configs set 1e-5 or 1e-6)."""

    scalenorm_epsilon: Annotated[float, Reads("neox/model/norms.py")] = Field(1.0e-8, gt=0, le=1)
    """Epsilon of scalenorm."""

    use_bias_in_norms: Annotated[bool, Reads("neox/model/norms.py")] = True
    """Learned bias in layernorm (rmsnorm and scalenorm have none)."""

    use_qk_layernorm: Annotated[bool, Reads("neox/model/attention.py")] = False
    """Normalise queries and keys per head before rotary, as Qwen3: a norm of `norm`'s kind over
    each head's head_dim features, one weight for q and one for k shared by all heads.
    (gpt-neox instead shares one norm over [heads per tp rank, head_dim] between q and k, so
    its checkpoints' qk norm weights do not map; OLMo-2 normalises the whole projection.)"""

    qk_layernorm_scope: Annotated[
        Literal["head", "projection"],
        Reads("neox/model/attention.py"),
        Restricted(
            "`projection` needs model_parallel_size 1.",
            example={"use_qk_layernorm": True, "qk_layernorm_scope": "projection"},
            broken_by=({"model_parallel_size": 2},),
        ),
    ] = "head"
    """What use_qk_layernorm normalises: each `head`'s features (Qwen3), or the whole query
    and key `projection`s, heads x head_dim features with a weight each (OLMoE, OLMo-2)."""

    pos_emb: Annotated[
        Literal["learned", "rotary", "alibi", "none"],
        Reads("neox/model/gpt.py", "neox/model/attention.py"),
    ] = "learned"
    """Positional information: rotary, learned absolute embeddings, ALiBi biases, or none."""

    rotary_pct: Annotated[float, Reads("neox/config/model.py")] = Field(1.0, gt=0, le=1)
    """Fraction of each head's dimensions that rotary embeddings rotate (Pythia: 0.25)."""

    rotary_emb_base: Annotated[int, Reads("neox/model/attention.py")] = Field(
        10000, ge=2, le=10**12
    )
    """Base of the rotary frequencies."""

    rotary_save_freqs_buffer: bool = False
    """No-op (gpt-neox key): rotary frequencies are recomputed from rotary_emb_base, never saved."""

    no_weight_tying: Annotated[bool, Reads("neox/model/gpt.py")] = False
    """Untie the output layer from the input embedding."""

    gpt_j_residual: Annotated[bool, Reads("neox/model/block.py")] = False
    """Parallel residual: x + attn(ln1(x)) + mlp(ln2(x)) (GPT-J, GPT-NeoX-20B, Pythia)."""

    gpt_j_tied: Annotated[bool, Reads("neox/model/block.py")] = False
    """With gpt_j_residual, share one norm between attention and MLP."""

    activation: Annotated[
        Literal["gelu", "gelu_tanh", "relu", "silu", "swish", "swiglu", "geglu"],
        Reads("neox/model/mlp.py"),
    ] = "gelu"
    """MLP activation; swiglu/geglu are gated (three projections)."""

    use_bias_in_attn_linear: Annotated[bool, Reads("neox/model/attention.py")] = True
    """Biases in the attention projections (query/key/value, and the output unless
    use_bias_in_attn_dense says otherwise)."""

    use_bias_in_attn_dense: Annotated[Optional[bool], Reads("neox/config/model.py")] = None
    """Bias in the attention output projection (None: as use_bias_in_attn_linear). Qwen2/2.5
    have q/k/v biases and none here: use_bias_in_attn_linear true, this false."""

    use_bias_in_mlp: Annotated[bool, Reads("neox/model/mlp.py")] = True
    """Biases in the MLP projections."""

    hidden_dropout: Annotated[float, Reads("neox/model/block.py")] = Field(0.0, ge=0, lt=1)
    """Dropout on each residual branch's output."""

    attention_dropout: Annotated[float, Reads("neox/model/attention.py")] = Field(0.0, ge=0, lt=1)
    """Dropout on attention probabilities."""

    init_method: Annotated[InitMethod, Reads("neox/model/init.py")] = "normal"
    """Initialisation of input-side weights."""

    output_layer_init_method: Annotated[InitMethod, Reads("neox/model/init.py")] = "scaled_normal"
    """Initialisation of weights that write into the residual stream."""

    init_method_std: Annotated[float, Reads("neox/model/init.py")] = Field(0.02, gt=0, le=10)
    """Standard deviation of the normal initialisers."""

    attention_config: Annotated[Optional[list[Any]], Reads("neox/config/model.py")] = None
    """gpt-neox per-layer attention types, e.g. [[["flash"], 24]] or [[["global", "local"], 12]]."""

    attention_impl: Annotated[
        Literal["auto", "flash", "flex", "triton", "torch"], Reads("neox/plan/attention_path.py")
    ] = "auto"
    """Attention kernel: flash = torch SDPA, flex = torch FlexAttention (block-sparse: skips the
    tiles a sliding window or packed documents mask out, adds ALiBi in the kernel; CUDA only, CPU
    ranks take SDPA; no attention_dropout), triton = scores + the fused Triton softmax, torch =
    reference. auto = the fastest exact one per layer: on GPU FlexAttention for sliding-window
    layers, packed documents (reset_attention_mask) and ALiBi, SDPA flash otherwise, also where
    the gpt-neox fusion flags ask for a fused softmax (the same math); SDPA elsewhere.
    `deepy.py --dry-run` names each layer's."""

    scaled_upper_triang_masked_softmax_fusion: Annotated[
        bool, Reads("neox/plan/attention_path.py")
    ] = False
    """gpt-neox key asking for a fused scale + causal mask + softmax; attention_impl auto runs that
    math fused further in SDPA flash, attention_impl: triton in the Triton softmax."""

    scaled_masked_softmax_fusion: Annotated[bool, Reads("neox/plan/attention_path.py")] = False
    """gpt-neox key asking for the fused softmax with a padding mask as well; read as
    scaled_upper_triang_masked_softmax_fusion is."""

    attention_softmax_in_fp32: Annotated[bool, Reads("neox/model/attention.py")] = True
    """Compute attention softmax in float32 under fp16/bf16."""

    apply_query_key_layer_scaling: bool = False
    """No-op (gpt-neox key): Megatron scales scores by 1/layer before an fp32 softmax and back,
    which changes nothing numerically; neox computes the softmax in fp32 directly."""

    bias_gelu_fusion: Annotated[bool, Reads("neox/model/mlp.py")] = False
    """Fuse bias + GELU (gpt-neox key; with it, gpt-neox's GELU is the tanh approximation)."""

    bias_dropout_fusion: bool = False
    """No-op (gpt-neox key): a kernel fusion of the same math; torch_compile fuses here."""

    use_flashattn_swiglu: bool = False
    """No-op (gpt-neox key): flash-attn's fused SwiGLU kernel computes the same function as
    neox's SwiGLU (activation: swiglu); torch_compile fuses here."""

    rope_fusion: bool = False
    """No-op (gpt-neox key): a fused rotary kernel of the same math."""

    layernorm_fusion: bool = False
    """No-op (gpt-neox key): torch's layernorm is already one fused kernel."""

    rmsnorm_fusion: bool = False
    """No-op (gpt-neox key): a fused rmsnorm kernel of the same math."""

    make_vocab_size_divisible_by: Annotated[int, Reads("neox/config/derived.py")] = Field(
        128, ge=1, le=1 << 16
    )
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""

    output_layer_parallelism: Annotated[
        Literal["column", "row"], Reads("neox/parallel/tensor.py")
    ] = "column"
    """How the output layer is split under tensor parallelism."""

    use_cpu_initialization: bool = False
    """No-op (gpt-neox key): weights are initialised shard by shard from the one-rank seed, so
    the result is the same wherever it is computed."""

    fp16_lm_cross_entropy: Annotated[
        bool,
        Refused(
            feature="cross-entropy in fp16 is not implemented",
            example=True,
            allowed=(False,),
            message=(
                "fp16_lm_cross_entropy=true: a cross-entropy in fp16 is not implemented in neox "
                "(the loss is always float32); remove the key"
            ),
        ),
    ] = False
    """gpt-neox key asking for the cross-entropy in fp16; not implemented: neox always computes
    the loss in float32, so it must be false."""

    opt_pos_emb_offset: Annotated[int, Reads("neox/model/gpt.py")] = Field(0, ge=0, le=1 << 16)
    """Offset of learned position ids (OPT uses 2)."""

    fused_kernels_build_path: Optional[str] = None
    """No-op (gpt-neox key): neox builds no CUDA extensions; its Triton kernels compile on use."""

    lm_loss_chunk_size: Annotated[
        int,
        Reads("neox/model/gpt.py", "neox/config/model.py", "neox/plan/memory.py"),
        Restricted(
            "Above 0, needs model_parallel_size 1 (tensor parallelism keeps its vocab-split "
            "loss, whose logits are already split) and pipe_parallel_size 1.",
            example={"lm_loss_chunk_size": 1024},
            broken_by=({"model_parallel_size": 2},),
        ),
    ] = Field(0, ge=0, le=MAX_COUNT)
    """Training loss from the output layer and cross-entropy fused, this many tokens at a time,
    so the full (tokens, vocab) float32 logits never exist (0: full logits). Same loss within
    float32 rounding."""

    _shape: ModelShape = PrivateAttr()

    @property
    def shape(self) -> ModelShape:
        """The sizes the model is built with (head size, kv heads, MLP width, rotary dims, layer
        types...), derived once when this config is validated (again on assignment)."""
        return self._shape

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
        self._shape = check_model(self)
        refuse_degenerate_shape(
            self._shape,
            pos_emb=self.pos_emb,
            rotary_pct=self.rotary_pct,
            heads=self.num_attention_heads,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            expansion_factor=self.expansion_factor,
        )
        refuse_local_without_window(self._shape, self.sliding_window_width)
        return self

    def check_run(self, tp: int, pp: int) -> None:
        """The chunked output-layer loss runs on the plain model's whole vocabulary only (run by
        `derive`)."""
        chunk = self.lm_loss_chunk_size
        if chunk < 0:
            raise ConfigError(f"lm_loss_chunk_size={chunk} must be >= 0 (0: full logits)")
        if chunk and (tp > 1 or pp > 1):
            raise ConfigError(
                f"lm_loss_chunk_size={chunk} needs model_parallel_size=1 and pipe_parallel_size=1 "
                f"(got {tp} and {pp}); set lm_loss_chunk_size 0 for this layout"
            )
        if self.use_qk_layernorm and self.qk_layernorm_scope == "projection" and tp > 1:
            raise ConfigError(
                f"qk_layernorm_scope=projection with model_parallel_size={tp}: a norm over all "
                "heads is not split over tensor-parallel ranks in neox; use model_parallel_size 1"
            )
        self.check_moe_run(tp, pp)


def check_model(m: ModelConfig) -> ModelShape:
    """The model's own cross-field rules (run when a ModelConfig is validated, since its shape
    depends on them); returns the shape. Raises ValueError naming the keys and the fix."""
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        raise ValueError(
            f"hidden_size={m.hidden_size} is not divisible by "
            f"num_attention_heads={m.num_attention_heads}; pick heads among "
            f"{_divisor_list(m.hidden_size)}, or set head_dim"
        )
    kv = m.num_kv_heads
    if kv is not None and m.num_attention_heads % kv:
        raise ValueError(
            f"num_attention_heads={m.num_attention_heads} is not divisible by "
            f"num_kv_heads={kv}; use one of {_divisor_list(m.num_attention_heads)}"
        )
    shape = model_shape(m)  # also checks attention_config
    if m.pos_emb == "rotary" and shape.rotary_dims % 2:
        raise ValueError(
            f"rotary_pct={m.rotary_pct} rotates {shape.head_dim * m.rotary_pct:g} of "
            f"{shape.head_dim} head dims; that must be an even whole number"
        )
    if m.max_position_embeddings is not None and m.seq_length > m.max_position_embeddings:
        raise ValueError(
            f"seq_length={m.seq_length} exceeds max_position_embeddings="
            f"{m.max_position_embeddings}; raise max_position_embeddings or shorten seq_length"
        )
    if m.gpt_j_tied and not m.gpt_j_residual:
        raise ValueError("gpt_j_tied=true needs gpt_j_residual=true")
    return shape


def _divisor_list(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0][:12]


def model_shape(m: ModelConfig) -> ModelShape:
    """The ModelShape of `m`; raises ValueError for an attention_config that does not fit."""
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    max_positions = m.max_position_embeddings or m.seq_length
    dense_bias = m.use_bias_in_attn_dense
    return ModelShape(
        attn_dense_bias=m.use_bias_in_attn_linear if dense_bias is None else dense_bias,
        rope=rope_scaling(
            {key: getattr(m, key) for key in ("rope_scaling_type", *ROPE_SCALING_KEYS.values())},
            m.rope_scaling,
            m.rotary_emb_base,
            m.pos_emb,
            max_positions,
        ),
        head_dim=head_dim,
        kv_heads=m.num_kv_heads or m.num_attention_heads,
        ffn_size=ffn_size(
            m.hidden_size,
            m.intermediate_size,
            m.expansion_factor,
            m.activation,
            m.mlp_multiple_of,
        ),
        gated_mlp=m.activation in GATED_ACTIVATIONS,
        rotary_dims=int(head_dim * m.rotary_pct),
        max_positions=max_positions,
        position_rows=max_positions + m.opt_pos_emb_offset,
        layer_types=layer_types(m.attention_config, m.num_layers),
    )
