"""Model architecture settings: the GPT-NeoX family (Pythia, GPT-NeoX-20B, Llama/Mistral-style)."""

from typing import Annotated, Any, Literal, Optional

from pydantic import Field, PrivateAttr, model_validator

from neox.config.base import (
    MAX_COUNT,
    MAX_LAYERS,
    MAX_MLP_WIDTH,
    MAX_POSITIONS,
    MAX_WIDTH,
    ConfigGroup,
    Reads,
    Refused,
)
from neox.config.derived import ModelShape, check_model

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


class ModelConfig(ConfigGroup):
    """Shape and options of the decoder."""

    num_layers: Annotated[int, Reads("neox/model/init.py", "neox/config/derived.py")] = Field(
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

    num_kv_heads: Annotated[Optional[int], Reads("neox/config/derived.py")] = Field(
        None, ge=1, le=MAX_WIDTH
    )
    """Key/value heads for grouped-query attention (None: same as num_attention_heads)."""

    intermediate_size: Annotated[Optional[int], Reads("neox/config/derived.py")] = Field(
        None, ge=1, le=MAX_MLP_WIDTH
    )
    """MLP width before gating (None: 4 x hidden); gated MLPs use 2/3 of it per branch, as gpt-neox."""

    mlp_multiple_of: Annotated[int, Reads("neox/config/derived.py")] = Field(
        1, ge=1, le=MAX_MLP_WIDTH
    )
    """Round the MLP inner width up to a multiple of this (Llama configs use 256)."""

    expansion_factor: Annotated[Optional[float], Reads("neox/config/derived.py")] = Field(
        None, gt=0, le=64
    )
    """MLP width as a multiple of hidden_size, used when intermediate_size is unset."""

    seq_length: Annotated[int, Reads("neox/training/setup.py")] = Field(128, ge=1, le=MAX_POSITIONS)
    """Training sequence length in tokens."""

    max_position_embeddings: Annotated[Optional[int], Reads("neox/config/derived.py")] = Field(
        None, ge=1, le=MAX_POSITIONS
    )
    """Longest position the model supports (None: seq_length); seq_length may not exceed it."""

    sliding_window_width: Annotated[Optional[int], Reads("neox/plan/attention_path.py")] = Field(
        None, ge=1, le=MAX_POSITIONS
    )
    """Attend only to the last N keys (Mistral-style local attention); None is full causal."""

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
    """Normalise queries and keys per head before attention."""

    pos_emb: Annotated[
        Literal["learned", "rotary", "alibi", "none"],
        Reads("neox/model/gpt.py", "neox/model/attention.py"),
    ] = "learned"
    """Positional information: rotary, learned absolute embeddings, ALiBi biases, or none."""

    rotary_pct: Annotated[float, Reads("neox/config/derived.py")] = Field(1.0, gt=0, le=1)
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
    """Biases in the attention projections."""

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

    attention_config: Annotated[Optional[list[Any]], Reads("neox/config/derived.py")] = None
    """gpt-neox per-layer attention types, e.g. [[["flash"], 24]] or [[["global", "local"], 12]]."""

    attention_impl: Annotated[
        Literal["auto", "flash", "triton", "torch"], Reads("neox/plan/attention_path.py")
    ] = "auto"
    """Attention kernel: flash = torch SDPA, triton = scores + fused Triton softmax, torch = reference;
    auto = flash on GPU unless attention_config or the fusion flags ask for the Triton softmax."""

    scaled_upper_triang_masked_softmax_fusion: Annotated[
        bool, Reads("neox/plan/attention_path.py")
    ] = False
    """Use the fused Triton scale + causal mask + softmax for `global` attention (gpt-neox key)."""

    scaled_masked_softmax_fusion: Annotated[bool, Reads("neox/plan/attention_path.py")] = False
    """Use the fused Triton softmax with a padding mask as well (gpt-neox key)."""

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
        int, Reads("neox/model/gpt.py", "neox/config/derived.py", "neox/plan/memory.py")
    ] = Field(0, ge=0, le=MAX_COUNT)
    """Training loss from the output layer and cross-entropy fused, this many tokens at a time,
    so the full (tokens, vocab) float32 logits never exist (0: full logits). Same loss within
    float32 rounding; needs model_parallel_size=1 (tensor parallelism keeps its vocab-split
    loss, whose logits are already split)."""

    _shape: ModelShape = PrivateAttr()

    @property
    def shape(self) -> ModelShape:
        """The sizes the model is built with (head size, kv heads, MLP width, rotary dims, layer
        types...), derived once when this config is validated (again on assignment)."""
        return self._shape

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
        self._shape = check_model(self)
        return self
