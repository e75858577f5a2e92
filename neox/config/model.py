"""Model architecture settings: the GPT-NeoX family (Pythia, GPT-NeoX-20B, Llama/Mistral-style)."""

from typing import Any, Literal, Optional

from pydantic import PrivateAttr, field_validator, model_validator

from neox.config.base import ConfigGroup, at_least, refuse_unless
from neox.config.derived import ModelShape, model_shape

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

    num_layers: int = 2
    """Number of transformer blocks."""

    hidden_size: int = 64
    """Width of the residual stream."""

    num_attention_heads: int = 4
    """Query heads per layer; hidden_size must be divisible by it."""

    num_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (None: same as num_attention_heads)."""

    intermediate_size: Optional[int] = None
    """MLP width before gating (None: 4 x hidden); gated MLPs use 2/3 of it per branch, as gpt-neox."""

    mlp_multiple_of: int = 1
    """Round the MLP inner width up to a multiple of this (Llama configs use 256)."""

    expansion_factor: Optional[float] = None
    """MLP width as a multiple of hidden_size, used when intermediate_size is unset."""

    seq_length: int = 128
    """Training sequence length in tokens."""

    max_position_embeddings: Optional[int] = None
    """Longest position the model supports (None: seq_length); seq_length may not exceed it."""

    sliding_window_width: Optional[int] = None
    """Attend only to the last N keys (Mistral-style local attention); None is full causal."""

    norm: Literal["layernorm", "rmsnorm", "scalenorm"] = "layernorm"
    """Normalisation layer."""

    layernorm_epsilon: float = 1.0e-5
    """Epsilon of layernorm."""

    rms_norm_epsilon: float = 1.0e-8
    """Epsilon of rmsnorm (gpt-neox default; Llama configs set 1e-5 or 1e-6)."""

    scalenorm_epsilon: float = 1.0e-8
    """Epsilon of scalenorm."""

    use_bias_in_norms: bool = True
    """Learned bias in layernorm (rmsnorm and scalenorm have none)."""

    use_qk_layernorm: bool = False
    """Normalise queries and keys per head before attention."""

    pos_emb: Literal["learned", "rotary", "alibi", "none"] = "learned"
    """Positional information: rotary, learned absolute embeddings, ALiBi biases, or none."""

    rotary_pct: float = 1.0
    """Fraction of each head's dimensions that rotary embeddings rotate (Pythia: 0.25)."""

    rotary_emb_base: int = 10000
    """Base of the rotary frequencies."""

    rotary_save_freqs_buffer: bool = False
    """No-op (gpt-neox key): rotary frequencies are recomputed from rotary_emb_base, never saved."""

    no_weight_tying: bool = False
    """Untie the output layer from the input embedding."""

    gpt_j_residual: bool = False
    """Parallel residual: x + attn(ln1(x)) + mlp(ln2(x)) (GPT-J, GPT-NeoX-20B, Pythia)."""

    gpt_j_tied: bool = False
    """With gpt_j_residual, share one norm between attention and MLP."""

    activation: Literal["gelu", "gelu_tanh", "relu", "silu", "swish", "swiglu", "geglu"] = "gelu"
    """MLP activation; swiglu/geglu are gated (three projections)."""

    use_bias_in_attn_linear: bool = True
    """Biases in the attention projections."""

    use_bias_in_mlp: bool = True
    """Biases in the MLP projections."""

    hidden_dropout: float = 0.0
    """Dropout on each residual branch's output."""

    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""

    init_method: InitMethod = "normal"
    """Initialisation of input-side weights."""

    output_layer_init_method: InitMethod = "scaled_normal"
    """Initialisation of weights that write into the residual stream."""

    init_method_std: float = 0.02
    """Standard deviation of the normal initialisers."""

    attention_config: Optional[list[Any]] = None
    """gpt-neox per-layer attention types, e.g. [[["flash"], 24]] or [[["global", "local"], 12]]."""

    attention_impl: Literal["auto", "flash", "triton", "torch"] = "auto"
    """Attention kernel: flash = torch SDPA, triton = scores + fused Triton softmax, torch = reference;
    auto = flash on GPU unless attention_config or the fusion flags ask for the Triton softmax."""

    scaled_upper_triang_masked_softmax_fusion: bool = False
    """Use the fused Triton scale + causal mask + softmax for `global` attention (gpt-neox key)."""

    scaled_masked_softmax_fusion: bool = False
    """Use the fused Triton softmax with a padding mask as well (gpt-neox key)."""

    attention_softmax_in_fp32: bool = True
    """Compute attention softmax in float32 under fp16/bf16."""

    apply_query_key_layer_scaling: bool = False
    """No-op (gpt-neox key): Megatron scales scores by 1/layer before an fp32 softmax and back,
    which changes nothing numerically; neox computes the softmax in fp32 directly."""

    bias_gelu_fusion: bool = False
    """Fuse bias + GELU (gpt-neox key; with it, gpt-neox's GELU is the tanh approximation)."""

    bias_dropout_fusion: bool = False
    """No-op (gpt-neox key): a kernel fusion of the same math; torch_compile fuses here."""

    rope_fusion: bool = False
    """No-op (gpt-neox key): a fused rotary kernel of the same math."""

    layernorm_fusion: bool = False
    """No-op (gpt-neox key): torch's layernorm is already one fused kernel."""

    rmsnorm_fusion: bool = False
    """No-op (gpt-neox key): a fused rmsnorm kernel of the same math."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""

    output_layer_parallelism: Literal["column", "row"] = "column"
    """How the output layer is split under tensor parallelism."""

    use_cpu_initialization: bool = False
    """No-op (gpt-neox key): weights are initialised shard by shard from the one-rank seed, so
    the result is the same wherever it is computed."""

    fp16_lm_cross_entropy: bool = False
    """gpt-neox key asking for the cross-entropy in fp16; not implemented: neox always computes
    the loss in float32, so it must be false."""

    opt_pos_emb_offset: int = 0
    """Offset of learned position ids (OPT uses 2)."""

    fused_kernels_build_path: Optional[str] = None
    """No-op (gpt-neox key): neox builds no CUDA extensions; its Triton kernels compile on use."""

    lm_loss_chunk_size: int = 0
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

    _no_fp16_cross_entropy = refuse_unless(
        "fp16_lm_cross_entropy",
        allowed=(False,),
        message="fp16_lm_cross_entropy=true: a cross-entropy in fp16 is not implemented in neox "
        "(the loss is always float32); remove the key",
    )
    _positive = at_least("num_layers", "hidden_size", "num_attention_heads", "seq_length", least=1)

    @field_validator("hidden_dropout", "attention_dropout")
    @classmethod
    def _probability(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {v}")
        return v

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; pick heads among "
                f"{_divisors(self.hidden_size)}"
            )
        kv = self.num_kv_heads
        if kv is not None and (kv < 1 or self.num_attention_heads % kv):
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_kv_heads={kv}; use one of {_divisors(self.num_attention_heads)}"
            )
        if not 0.0 < self.rotary_pct <= 1.0:
            raise ValueError(f"rotary_pct={self.rotary_pct} must be in (0, 1]")
        self._shape = shape = model_shape(self)  # also checks attention_config
        if self.pos_emb == "rotary" and shape.rotary_dims % 2:
            raise ValueError(
                f"rotary_pct={self.rotary_pct} rotates {shape.head_dim * self.rotary_pct:g} of "
                f"{shape.head_dim} head dims; that must be an even whole number"
            )
        if self.max_position_embeddings is not None and (
            self.seq_length > self.max_position_embeddings
        ):
            raise ValueError(
                f"seq_length={self.seq_length} exceeds max_position_embeddings="
                f"{self.max_position_embeddings}; raise max_position_embeddings or shorten seq_length"
            )
        if self.gpt_j_tied and not self.gpt_j_residual:
            raise ValueError("gpt_j_tied=true needs gpt_j_residual=true")
        return self


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0][:12]
