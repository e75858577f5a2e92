"""GPU memory of one training rank, computed without torch, as neox's engines allocate it.

Every quantity is bytes on the busiest rank (the largest pipeline stage for parameters, the
stage whose activations and loss peak highest). Which engine runs is neox.plan.engine_choice's
decision, as on the ranks: neox's flat engine (neox/training/flat_engine.py) for data
parallelism alone in bf16/fp32 with Adam at ZeRO 0-1, else DeepSpeed 0.19's. The parts, and
where each comes from:

- weights: the low-precision (or fp32) parameters the model computes with. Flat engine: one
  buffer per optimizer group (matrices; biases and norms), each padded to a multiple of 2 x dp.
  ZeRO-3 keeps 1/dp of each tensor, except tensors smaller than
  stage3_param_persistence_threshold, kept whole.
- gradients: the most backward holds at once. The flat engine and ZeRO 0-1 hold a full-size
  gradient per parameter (the flat engine in buffers shaped as its weights'); stage 2 and 3
  keep this rank's partition in one contiguous buffer, plus the gradient just produced (at
  most the largest tensor's; at ZeRO-3 with neox's blocks as leaves, at least a block's)
  awaiting its bucket.
- master weights: fp32 copies the optimizer updates (flat engine: this rank's 1/dp partition,
  none in fp32, where it steps the weights themselves; DeepSpeed: FP16_Optimizer at stage 0
  with fp16/bf16, ZeRO 1-3 always, 1/dp of them, even in fp32, where it clones its partition).
- optimizer states: Adam's two fp32 moments (Lion and SGD with momentum one) over what the
  optimizer owns: all parameters at DeepSpeed's stage 0, 1/dp from stage 1 on and always in
  the flat engine.
- buffers: ZeRO's gradient buckets (reduce_bucket_size elements, two when overlap_comm at
  stage 1/2), alive during backward. None in the flat engine (its overlap_comm buckets are
  slices of its gradient buffer).
- gathered params: ZeRO-3's parameters gathered whole for compute: one block plus
  stage3_prefetch_bucket_size (at most stage3_max_live_parameters, at least the largest tensor).
- step transient: the fp32 flat gradient the optimizer steps on (FP16_Optimizer: the full
  model; ZeRO 1/2: this rank's partition; ZeRO-3: its largest sub-group). The flat engine's
  one-pass AdamW (neox/kernels/adamw.py, bf16 on a GPU) reads the bf16 gradient itself: none;
  otherwise (torch's fused AdamW) an fp32 copy of the gradient partition in bf16.
- activations: what autograd saves for backward, tensor by tensor as neox's model runs
  (`block_activation_bytes`), for every micro-batch in flight (1F1B: stage i holds
  min(pp - i, accumulation)), or only the block inputs plus one recomputed chunk under
  activation checkpointing; with pp > 1, of the stage where activations plus loss peak.
- logits: the loss's peak on the last stage (`logits_bytes`), by how it runs
  (neox.plan.engine_choice.loss_path). Eager: fp32; at the start of backward the saved
  log-softmax, its gradient and the gradient of the logits coexist (LOSS_BYTES_PER_LOGIT per
  logit). Compiled (torch_compile, the GPU default; vocab-parallel under tensor parallelism,
  on a pipeline the last stage's): the logits in the compute dtype are all the graph saves,
  and its backward writes their gradient into the same buffer (AOTAutograd donates saved
  buffers to the backward graph), next to the gradients of the head weight and of the hidden
  states. Chunked (lm_loss_chunk_size): one chunk's fp32 softmax and its gradient, and the fp32
  head-weight gradient kept for backward.
- overheads (documented constants): the CUDA context and the caching allocator's slack.

ZeRO-Offload (zero_optimization.offload_optimizer / offload_param, device cpu) moves parts to
host memory, counted apart (`host_*`, per rank, as DeepSpeed 0.19 allocates them, pinned by
default): offload_optimizer puts the fp32 master partition, its fp32 gradient and the CPU Adam
moments on the host (stage 1/2 also a bf16 staging copy of the partition and a gradient buffer
of the largest tensor; stage 3 its flat gradient partition in the gradient-accumulation dtype),
and the GPU keeps no master, no moments and no fp32 step copy; offload_param (stage 3) keeps
the parameter partitions on the host, the GPU only the persistent small tensors. With device
nvme the moments and masters live on disk and only DeepSpeed's swap buffers (buffer_count x
buffer_size) are counted on the host.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from neox.config.derived import Derived
from neox.config.ds_config import BLOCK_CLASS, zero_section
from neox.config.model import ModelConfig
from neox.config.schema import NeoXConfig
from neox.plan.attention_path import select_attention_path
from neox.plan.engine_choice import (
    FLAT_OPTIMIZERS,
    engine_for,
    loss_path,
    one_pass_adamw,
    torch_compile_enabled,
)
from neox.plan.estimate import (
    blocks_per_stage,
    layer_parameters,
    lora_block_parameters,
    stage_tensor_sizes,
    vector_parameters,
)

GiB = 1024**3

# Bytes per logit at the eager loss's peak (start of backward): fp32 log-softmax kept for
# backward, its incoming gradient and the gradient of the logits (4 + 4 + 4).
LOSS_BYTES_PER_LOGIT = 12
# Bytes per token the compiled loss saves besides the logits: fp32 row max and logsumexp.
COMPILED_LOSS_BYTES_PER_TOKEN = 8
# The flat engine pads each group to a multiple of this times dp (flat_engine.ALIGNMENT).
FLAT_ALIGNMENT = 2
# CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers: outside torch's allocator, so absent
# from max_memory_reserved but part of what the GPU must hold. Measured ~0.5-0.8 GiB on H100.
CUDA_CONTEXT_BYTES = int(0.75 * GiB)
# The caching allocator reserves more than is allocated (block rounding, fragmentation).
ALLOCATOR_SLACK = 0.08
# DeepSpeed defaults (deepspeed/runtime/zero/config.py) used when the config leaves them out.
ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "contiguous_gradients": True,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
# DeepSpeed's NVMe swap defaults (deepspeed/runtime/zero/offload_config.py).
NVME_DEFAULTS = {"buffer_count": 5, "buffer_size": 100_000_000}
# A training rank's host memory besides the buffers counted: torch, CUDA and NCCL libraries,
# DeepSpeed's ops, compiled graphs, the data loader, and DeepSpeed's smaller offload buffers.
# Pythia-2.8B at ZeRO-3 with both offloads on an H100 host grew by 67.4 GiB against 60.7 GiB
# counted (docs/benchmarks.md, 2026-11-26), so 8 GiB per rank covers the rest.
HOST_PROCESS_BYTES = int(8 * GiB)
# fp32 optimizer-state values per parameter.
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "cpu_adam": 2, "cpu_torch_adam": 2, "lion": 1}
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class TrainingShape:
    """What memory depends on beyond the model: layout, batch, precision, ZeRO, checkpointing."""

    vocab_size: int  # padded
    tp: int = 1
    pp: int = 1
    dp: int = 1  # ranks ZeRO partitions over: data x context parallel
    cp: int = 1  # context_parallel_size: ranks that share each sequence, a chunk each
    sp: bool = False  # sequence_parallel at tp > 1: norms and dropout on 1/tp of the tokens
    micro_batch: int = 1
    grad_accum: int = 1
    precision: str = "bf16"
    zero_stage: int = 0
    zero: Optional[dict[str, Any]] = None  # DeepSpeed zero_optimization section
    optimizer: str = "adam"
    sgd_momentum: bool = False
    checkpoint_activations: bool = False
    checkpoint_num_layers: int = 1
    partition_activations: bool = False
    activation_memory_budget: float = 1.0  # compiled blocks: fraction of activations kept
    engine: str = "deepspeed"  # or "flat": neox's flat engine (neox.plan.engine_choice)
    loss: str = "eager"  # or "compiled", "chunked" (neox.plan.engine_choice.loss_path)
    loss_chunk: int = 0  # tokens per chunk of the chunked loss (lm_loss_chunk_size)
    one_pass_adamw: bool = True  # flat engine: AdamW in one pass over the bf16 gradient (GPU)
    pinned_host: bool = True  # offload buffers are pinned (CUDA; a no-op on CPU ranks)
    reference: bool = False  # DPO/KTO: a frozen copy of the weights (neox/training/preference.py)
    lora_parameters: int = 0  # LoRA adapter elements per rank; 0: every parameter trains
    async_save: bool = False  # checkpoints staged in host memory (neox/checkpoint/async_save.py)

    def zero_setting(self, key: str) -> Any:
        zero = self.zero or {}
        short = key.removeprefix("stage3_")
        return zero.get(key, zero.get(short, ZERO_DEFAULTS[key]))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU; `peak_allocated` is what torch.cuda.max_memory_allocated should read."""

    weights: int
    gradients: int
    master_weights: int
    optimizer_states: int
    buffers: int
    gathered_params: int
    step_transient: int
    activations: int
    logits: int
    host_master_weights: int = 0
    host_gradients: int = 0
    host_optimizer_states: int = 0
    host_params: int = 0
    host_buffers: int = 0
    host_checkpoint_staging: int = 0

    @property
    def host_total(self) -> int:
        """Host memory ZeRO-Offload and async_save allocate on one rank (the process itself not
        counted)."""
        return (
            self.host_master_weights
            + self.host_gradients
            + self.host_optimizer_states
            + self.host_params
            + self.host_buffers
            + self.host_checkpoint_staging
        )

    @property
    def model_states(self) -> int:
        return self.weights + self.gradients + self.master_weights + self.optimizer_states

    @property
    def peak_allocated(self) -> int:
        """The larger of the backward peak (activations, buckets) and the optimizer-step peak."""
        backward = self.buffers + self.gathered_params + self.activations + self.logits
        return self.model_states + max(backward, self.step_transient)

    @property
    def peak_reserved(self) -> int:
        """max_memory_reserved: allocated plus the caching allocator's slack."""
        return int(self.peak_allocated * (1 + ALLOCATOR_SLACK))

    @property
    def total(self) -> int:
        """What the GPU must hold: reserved plus the CUDA context."""
        return self.peak_reserved + CUDA_CONTEXT_BYTES

    def as_dict(self) -> dict[str, int]:
        parts = asdict(self)
        parts.update(
            peak_allocated=self.peak_allocated,
            peak_reserved=self.peak_reserved,
            total=self.total,
            host_total=self.host_total,
        )
        return parts


def lora_parameter_count(cfg: NeoXConfig, tp: int) -> int:
    """Adapter elements on one rank of a LoRA run (pipeline parallelism is refused with LoRA)."""
    lo = cfg.lora
    if not lo.lora_rank:
        return 0
    block = lora_block_parameters(cfg.model, lo.lora_rank, lo.lora_target_modules, tp)
    return cfg.model.num_layers * block


def training_shape(
    cfg: NeoXConfig,
    derived: Derived,
    vocab_size: int,
    zero_stage: Optional[int] = None,
    device: str = "cuda",
) -> TrainingShape:
    """The TrainingShape of a validated config run on `device` ("cuda" or "cpu": torch_compile's
    default and the flat engine's AdamW kernel depend on it); zero_stage overrides the
    configured stage."""
    cp = derived.context_parallel
    zero = zero_section(cfg, derived.data_parallel * cp, zero_stage)
    t, spec = cfg.training, cfg.optimizer.optimizer
    tp, pp = derived.tensor_parallel, derived.pipe_parallel
    sp = cfg.parallel.splits_sequence  # it turns partition_activations off
    compiled = torch_compile_enabled(t.torch_compile, device)
    pref = cfg.preference
    # DPO and RM run each pair's two answers as two rows, over full (eager) logits.
    rows = 2 if pref.train_impl in ("dpo", "rm") else 1
    preference = pref.train_impl != "normal"
    return TrainingShape(
        vocab_size=vocab_size,
        tp=tp,
        pp=pp,
        dp=derived.data_parallel * cp,
        cp=cp,
        sp=sp,
        micro_batch=derived.micro_batch * rows,
        grad_accum=derived.grad_accum,
        precision=derived.precision,
        zero_stage=int(zero["stage"]),
        zero=zero,
        optimizer=derived.optimizer_type,
        sgd_momentum=bool(spec.params.get("momentum", 0)),
        checkpoint_activations=t.checkpoint_activations,
        checkpoint_num_layers=t.checkpoint_num_layers,
        partition_activations=t.partition_activations and not sp,
        activation_memory_budget=t.activation_memory_budget if compiled else 1.0,
        engine=engine_for(cfg, derived, zero_stage).engine,
        loss="eager" if preference else loss_path(compiled, cfg.model.lm_loss_chunk_size),
        loss_chunk=0 if preference else cfg.model.lm_loss_chunk_size,
        pinned_host=device == "cuda",
        lora_parameters=lora_parameter_count(cfg, tp),
        one_pass_adamw=one_pass_adamw(
            derived.optimizer_type in FLAT_OPTIMIZERS,  # neox builds torch's AdamW for both
            bool(spec.params.get("amsgrad")),
            bool(spec.params.get("maximize")),
            device,
        ),
        async_save=cfg.checkpoint.async_save,
        reference=pref.train_impl == "kto"
        or (pref.train_impl == "dpo" and not pref.dpo_reference_free),
    )


def norm_activation_bytes(cfg: ModelConfig, k: int, dim: int) -> tuple[int, int]:
    """Bytes one norm saves per row of `dim` features: (its input, which another norm reading
    the same tensor shares, or 0 when it saves a copy; what it saves of its own)."""
    if cfg.norm == "layernorm":
        return k * dim, 8  # input; fp32 mean and rstd
    if cfg.norm == "rmsnorm":
        # Normalises x.float(): a copy under fp16/bf16, x itself in fp32; then the scaled output.
        copy = 0 if k == 4 else 4 * dim
        return (4 * dim if k == 4 else 0), copy + k * dim + 4
    return k * dim, k * dim + 4  # scalenorm: input; x / ||x|| and the norm


def block_activation_bytes(
    cfg: ModelConfig,
    layer_type: str,
    seq: int,
    micro_batch: int,
    k: int,
    tp: int = 1,
    cp: int = 1,
    sp: bool = False,
) -> int:
    """Bytes autograd saves in one block's forward for backward, as neox's Block runs it.

    Counted per token (b x s of them): norm inputs and linear inputs of width h (replicated
    over tp), then per tp shard the attention's q, k, v, output and the dense layer's input, and
    the MLP's inner activations; plus whole-sequence terms for materialised scores and masks.
    Under context parallelism (cp) a rank holds s / cp tokens, and its attention kernel the
    whole sequence for heads / cp (the same bytes per q, k, v, output; scores of s x s for
    heads / cp). Under sequence parallelism (sp) the norms, the dropout masks and the
    column-parallel linears' saved inputs (this rank's chunk of the gathered norm output) hold
    s / tp tokens.
    """
    shape = cfg.shape
    h, hs = cfg.hidden_size, shape.head_dim
    nh, nkv = cfg.num_attention_heads // tp, shape.kv_heads // tp
    hq, hkv, ffn = nh * hs, nkv * hs, shape.ffn_size // tp
    tokens = seq * micro_batch // cp
    kernel = select_attention_path(cfg, layer_type, "cuda").impl

    # The norms (under sp on this rank's chunk of the tokens, as is all of `chunked`).
    shared, own = norm_activation_bytes(cfg, k, h)
    if cfg.gpt_j_residual:
        # x + attn(ln1(x)) + mlp(ln2(x)): both norms read the same x.
        chunked = shared + own * (1 if cfg.gpt_j_tied else 2)
    else:
        chunked = 2 * (shared + own)
    if cfg.hidden_dropout > 0:
        chunked += 2 * h  # bool masks of the two residual branches
    # The inputs of qkv and of the MLP (gate and up read one): under sp each saves its chunk.
    linear_inputs = (1 if cfg.gpt_j_tied else 2) * k * h
    if sp:
        chunked += linear_inputs
    per_token = 0 if sp else linear_inputs
    mha = shape.kv_heads == cfg.num_attention_heads
    rotary, qk_norm = cfg.pos_emb == "rotary", cfg.use_qk_layernorm
    kv = hkv if mha else hq  # GQA repeats k and v over the query group
    if kernel in ("flash", "flex"):
        # SDPA (FlexAttention too) saves q, k, v and its output. q and k are new tensors when
        # rotated or normed (q also when GQA's strided slice must be copied), v only when
        # repeated; a view of k or v keeps the whole fused qkv output alive. Rotated q is laid out (B, nh, T, hs), so
        # the output is too, and the dense layer saves a (B, T, C) copy of it.
        per_token += k * hq if (rotary or qk_norm or not mha) else 0
        per_token += k * kv if (rotary or qk_norm or not mha) else 0
        per_token += 0 if mha else k * hq
        per_token += k * (hq + 2 * hkv) if (mha or qk_norm) else 0
        per_token += k * hq * (2 if (rotary or qk_norm) else 1)
    else:
        # Batched matmuls save q, k and v as (B*nh, T, hs) copies or views, and the dense layer
        # the (B, T, C) copy of probs @ v; the scores terms come below.
        per_token += k * (2 * hq + 2 * kv)
        per_token += k * (hq + 2 * hkv) if qk_norm else 0
    if rotary:
        # Training passes position ids, so each layer gathers its own cos and sin (B, T, dim).
        per_token += 2 * k * shape.rotary_dims
    if qk_norm:
        q_shared, q_own = norm_activation_bytes(cfg, k, hs)
        per_token += (0 if mha else q_shared * nh) + q_own * (nh + nkv)
    # MLP inner activations.
    if shape.gated_mlp:
        per_token += 4 * k * ffn  # gate out, act(gate), up out, their product
    elif cfg.activation == "relu":
        per_token += k * ffn  # relu saves its output, which the down projection also saves
    else:
        per_token += 2 * k * ffn  # up out (activation input), activation out
    total = per_token * tokens + chunked * tokens // (tp if sp else 1)
    # Whole-sequence terms (Ulysses: the whole sequence for heads / cp).
    nh //= cp
    scores = micro_batch * nh * seq * seq
    if kernel in ("flash", "flex"):
        total += 4 * nh * seq * micro_batch  # logsumexp
        if kernel == "flash" and (cfg.pos_emb == "alibi" or cfg.sliding_window_width is not None):
            total += k * nh * seq * seq  # the explicit additive mask SDPA then saves
    else:
        fp32_probs = kernel == "torch" and cfg.attention_softmax_in_fp32 and k != 4
        total += scores * (4 + k if fp32_probs else k)  # softmax output, and its cast for @v
        total += scores if cfg.attention_dropout > 0 else 0
    return total


def activation_bytes(cfg: ModelConfig, shape: TrainingShape, stage: int = 0) -> int:
    """Bytes of saved activations on pipeline stage `stage` at the start of backward.

    Under DeepSpeed's 1F1B schedule stage i holds min(pp - i, accumulation) micro-batches.
    """
    k = BYTES[shape.precision]
    s, b, tp, pp = cfg.seq_length, shape.micro_batch, shape.tp, shape.pp
    counts = blocks_per_stage(cfg.num_layers, pp)
    first = sum(counts[:stage])
    types = cfg.shape.layer_types[first : first + counts[stage]]
    per_block = [block_activation_bytes(cfg, t, s, b, k, tp, shape.cp, shape.sp) for t in types]
    s //= shape.cp  # the tokens of this rank's chunk, from here on
    # Sequence parallelism: the tokens between the blocks (their inputs, the final norm's).
    between = s // tp if shape.sp else s
    if shape.checkpoint_activations:
        # Only each chunk's input survives forward; backward recomputes one chunk at a time.
        layers = max(1, shape.checkpoint_num_layers)
        kept = between * b * cfg.hidden_size * k // (tp if shape.partition_activations else 1)
        total = -(-len(types) // layers) * kept + max(per_block[:layers])
    else:
        # A budget below 1 keeps that fraction of what a block saves beyond its input, which
        # even recomputing everything keeps (torch's partitioner interpolates between the two).
        kept = between * b * cfg.hidden_size * k
        budget = shape.activation_memory_budget
        total = sum(kept + int(budget * max(0, block - kept)) for block in per_block)
    if stage == 0 and cfg.hidden_dropout > 0:
        total += between * b * cfg.hidden_size  # embedding dropout mask
    if stage == pp - 1:
        # The head: final norm input and the output layer's input (under sp its saved chunk).
        shared, own = norm_activation_bytes(cfg, k, cfg.hidden_size)
        total += between * b * (shared + own + k * cfg.hidden_size)
    return total * min(pp - stage, shape.grad_accum)


def logits_bytes(cfg: ModelConfig, shape: TrainingShape) -> int:
    """The loss's peak on the last stage, beyond the activations (which count the final norm's
    and the output layer's inputs): at the start of backward, or within a chunk."""
    k, h = BYTES[shape.precision], cfg.hidden_size
    tokens = cfg.seq_length // shape.cp * shape.micro_batch
    vocab = shape.vocab_size // shape.tp
    if shape.loss == "compiled":
        # At the end of its backward: the logits' gradient in their buffer, beside the head
        # weight's and the hidden states' gradients.
        return tokens * (k * vocab + COMPILED_LOSS_BYTES_PER_TOKEN + k * h) + k * vocab * h
    if shape.loss == "chunked":
        # dh (saved for backward) takes the place of the output layer's input; the fp32 head
        # gradient dw is kept too. Forward: a chunk's fp32 logits, softmax, its scaled copy
        # and that cast to the weights' dtype (no copy in fp32); backward: dh and dw scaled by
        # the incoming gradient, dw's cast.
        cast = 0 if k == 4 else k
        rows = min(shape.loss_chunk, tokens)
        chunk = (12 + cast) * rows * vocab
        backward = k * tokens * h + (4 + cast) * vocab * h
        return 4 * vocab * h + max(chunk, backward)
    return LOSS_BYTES_PER_LOGIT * tokens * vocab


def flat_engine_states(cfg: ModelConfig, shape: TrainingShape) -> MemoryEstimate:
    """The model-state parts of neox's flat engine: per optimizer group (matrices; biases and
    norms) a padded bf16/fp32 weight buffer and gradient buffer, and fp32 master weights and
    Adam moments of this rank's 1/dp partition; no buckets. Activations and logits are 0."""
    k, dp = BYTES[shape.precision], shape.dp
    total = sum(stage_tensor_sizes(cfg, shape.vocab_size))
    vectors = vector_parameters(cfg)
    unit = FLAT_ALIGNMENT * dp
    padded = sum(-(-n // unit) * unit for n in (total - vectors, vectors))
    part = padded // dp
    mixed = shape.precision != "fp32"
    return MemoryEstimate(
        weights=k * padded,
        gradients=k * padded,
        master_weights=4 * part if mixed else 0,  # fp32 steps the weight partition itself
        optimizer_states=4 * 2 * part,
        buffers=0,
        gathered_params=0,
        # torch's fused AdamW steps fp32 gradients: a copy of the bf16 partition.
        step_transient=4 * part if mixed and not shape.one_pass_adamw else 0,
        activations=0,
        logits=0,
    )


def lora_states(cfg: ModelConfig, shape: TrainingShape) -> MemoryEstimate:
    """The model-state parts of a LoRA run: the frozen base's weights alone, and for the
    adapters (small enough that ZeRO's partitioning and buckets change little) weights,
    gradients, fp32 masters and Adam moments. The adapters' own activations (an r-wide vector
    per token and target) are left out. Activations and logits are 0."""
    k = BYTES[shape.precision]
    base = max(
        sum(stage_tensor_sizes(cfg, shape.vocab_size, shape.tp, shape.pp, s))
        for s in range(shape.pp)
    )
    n = shape.lora_parameters
    mixed = shape.precision != "fp32"
    return MemoryEstimate(
        weights=k * (base + n),
        gradients=k * n,
        master_weights=4 * n if mixed else 0,
        optimizer_states=4 * 2 * n,
        buffers=0,
        gathered_params=0,
        step_transient=4 * n if mixed else 0,
        activations=0,
        logits=0,
    )


def estimate_memory(cfg: ModelConfig, shape: TrainingShape) -> MemoryEstimate:
    """Memory of the busiest rank for this model and training shape; DPO/KTO's frozen reference
    copy adds one more set of this rank's weights (never partitioned by ZeRO)."""
    est = _estimate_memory(cfg, shape)
    if shape.async_save:
        # Data-parallel rank 0 copies its stage's tensor-parallel shard whole: the fp32 weight
        # and Adam's two moments of every trainable element (neox/checkpoint/plain_state.py).
        # An upper bound but at ZeRO-0: under ZeRO 1-3 and the flat engine each rank copies
        # only its own partitions (about 1/DP of it; neox/checkpoint/host_staging.py).
        trainable = shape.lora_parameters or max(
            sum(stage_tensor_sizes(cfg, shape.vocab_size, shape.tp, shape.pp, s))
            for s in range(shape.pp)
        )
        est = replace(est, host_checkpoint_staging=12 * trainable)
    if not shape.reference:
        return est
    sizes = stage_tensor_sizes(cfg, shape.vocab_size, shape.tp, shape.pp, 0)
    return replace(est, weights=est.weights + BYTES[shape.precision] * sum(sizes))


def _estimate_memory(cfg: ModelConfig, shape: TrainingShape) -> MemoryEstimate:
    # The busiest stage in backward: the first holds the most micro-batches, the last the loss.
    last = shape.pp - 1
    activations, logits = max(
        (
            (activation_bytes(cfg, shape, i), logits_bytes(cfg, shape) if i == last else 0)
            for i in range(shape.pp)
        ),
        key=sum,
    )
    if shape.lora_parameters:
        return replace(lora_states(cfg, shape), activations=activations, logits=logits)
    if shape.engine == "flat":
        states = flat_engine_states(cfg, shape)
        return replace(states, activations=activations, logits=logits)
    k = BYTES[shape.precision]
    mixed = shape.precision != "fp32"
    dp, stage = shape.dp, shape.zero_stage
    sizes = max(
        (stage_tensor_sizes(cfg, shape.vocab_size, shape.tp, shape.pp, s) for s in range(shape.pp)),
        key=sum,
    )
    n = sum(sizes)
    part = -(-n // dp)  # this rank's partition (ZeRO pads to equal partitions)

    if stage >= 3:
        threshold = shape.zero_setting("stage3_param_persistence_threshold")
        weights = k * sum(x if x < threshold else -(-x // dp) for x in sizes)
    else:
        weights = k * n
    owned = n if stage == 0 else part  # parameters whose optimizer state lives here
    # An fp32 run at stage 0 steps the model's own tensors; ZeRO clones its partition anyway.
    master = 4 * owned if (mixed or stage > 0) else 0
    states = OPTIMIZER_STATES.get(shape.optimizer, 1 if shape.sgd_momentum else 0)
    optimizer_states = 4 * states * owned
    # Stage 2/3 reduce each gradient as it arrives, but it arrives whole: add the largest. A
    # ZeRO-3 leaf block (neox's default) is reduced once its whole backward is done: a block's.
    arriving = max(sizes)
    leaves = ((shape.zero or {}).get("leaf_module") or {}).get("classes") or []
    if stage >= 3 and BLOCK_CLASS in leaves:
        arriving = max(arriving, layer_parameters(cfg, shape.tp))
    gradients = k * n if stage <= 1 else k * (part + arriving)

    bucket = shape.zero_setting("reduce_bucket_size")
    overlap = (shape.zero or {}).get("overlap_comm", stage == 3)
    buffers = gathered_bytes = 0
    if stage in (1, 2) and shape.zero_setting("contiguous_gradients"):
        # Allocated at the full reduce_bucket_size, however small the model.
        buffers = k * bucket * (2 if overlap and shape.pp == 1 else 1)
    elif stage == 3:
        # Gathered parameters in flight: the block being computed plus the prefetch bucket,
        # at most max_live_parameters; never less than the largest tensor (the embedding).
        gathered = min(
            shape.zero_setting("stage3_max_live_parameters"),
            layer_parameters(cfg, shape.tp) + shape.zero_setting("stage3_prefetch_bucket_size"),
            n,
        )
        buffers = k * bucket if shape.zero_setting("contiguous_gradients") else 0
        gathered_bytes = k * max(gathered, max(sizes))
    if stage == 0:
        step = 4 * n if mixed else 0
    elif stage in (1, 2):
        step = 4 * part
    else:
        step = 4 * min(part, shape.zero_setting("sub_group_size"))
    on_gpu = MemoryEstimate(
        weights=weights,
        gradients=gradients,
        master_weights=master,
        optimizer_states=optimizer_states,
        buffers=buffers,
        gathered_params=gathered_bytes,
        step_transient=step,
        activations=activations,
        logits=logits,
    )
    return offloaded(on_gpu, shape, sizes, part, vector_parameters(cfg))


def _offload_device(shape: TrainingShape, key: str) -> str:
    return ((shape.zero or {}).get(key) or {}).get("device", "none")


def pinned_bytes(nbytes: int, pinned: bool) -> int:
    """Host bytes of one pinned buffer: torch's caching host allocator rounds each pinned
    allocation up to a power of two (pinned_max_round_threshold is unlimited by default)."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes > 0 else nbytes


def offloaded(
    est: MemoryEstimate, shape: TrainingShape, sizes: list[int], part: int, vectors: int
) -> MemoryEstimate:
    """`est` with ZeRO-Offload's parts moved from the GPU to the host (DeepSpeed 0.19's
    stage_1_and_2.py and stage3.py allocations; see the module docstring). DeepSpeed keeps one
    flat buffer per optimizer group (matrices; `vectors` biases and norms), ZeRO-3 one per
    sub-group of at most sub_group_size elements; each pinned one is rounded (pinned_bytes)."""
    k, stage, dp = BYTES[shape.precision], shape.zero_stage, shape.dp
    optimizer = _offload_device(shape, "offload_optimizer") if stage else "none"
    params = _offload_device(shape, "offload_param") if stage == 3 else "none"
    if optimizer == "none" and params == "none":
        return est
    zero = shape.zero or {}
    vectors = min(vectors, sum(sizes))
    groups = [-(-g // dp) for g in (sum(sizes) - vectors, vectors) if g]  # this rank's shares
    if stage == 3:  # sub-groups of at most sub_group_size elements
        limit = shape.zero_setting("sub_group_size")
        groups = [min(limit, g - i) for g in groups for i in range(0, g, limit)]

    def host_sum(nbytes_each: int, key: str, buffers=None) -> int:
        pinned = shape.pinned_host and (zero.get(key) or {}).get("pin_memory", True)
        return sum(pinned_bytes(nbytes_each * n, pinned) for n in buffers or groups)

    host: dict[str, int] = {}
    gpu: dict[str, int] = {}
    largest = max(sizes)
    if optimizer != "none":
        gpu.update(master_weights=0, optimizer_states=0, step_transient=0)
        states = est.optimizer_states // max(1, part)  # bytes of moments per parameter
        if optimizer == "cpu":
            host.update(
                host_master_weights=host_sum(4, "offload_optimizer"),
                host_gradients=host_sum(4, "offload_optimizer"),  # what CPU Adam steps on
                host_optimizer_states=states * part,  # CPU Adam's own, not pinned
            )
        else:  # nvme: masters, gradients and moments swap through pinned buffers
            count = (zero.get("offload_optimizer") or {}).get("buffer_count", 4)
            host["host_buffers"] = count * 4 * min(part, shape.zero_setting("sub_group_size"))
        if stage in (1, 2):
            # A bf16 staging copy of each group's partition and a buffer of the largest
            # gradient on the host; the GPU copies each gradient through one of that size.
            host["host_buffers"] = (
                host.get("host_buffers", 0)
                + host_sum(k, "offload_optimizer")
                + host_sum(k, "offload_optimizer", [largest])
            )
            if shape.grad_accum > 1:  # gradients accumulated across micro-batches
                host["host_gradients"] = host.get("host_gradients", 0) + k * part
            gpu["gradients"] = (k * sum(sizes) if stage == 1 else 0) + k * largest
        else:
            # The flat gradient partition moves to the host; the GPU keeps the one just made.
            host["host_gradients"] = host.get("host_gradients", 0) + host_sum(
                k, "offload_optimizer", [part]
            )
            gpu["gradients"] = k * largest
    if params != "none":
        threshold = shape.zero_setting("stage3_param_persistence_threshold")
        gpu["weights"] = k * sum(x for x in sizes if x < threshold)
        if params == "cpu":
            # One pinned buffer per optimizer group, pinned whatever pin_memory says.
            whole = [-(-g // dp) for g in (sum(sizes) - vectors, vectors) if g]
            host["host_params"] = sum(pinned_bytes(k * n, shape.pinned_host) for n in whole)
        else:
            swap = zero.get("offload_param") or {}
            count = swap.get("buffer_count", NVME_DEFAULTS["buffer_count"])
            size = swap.get("buffer_size", NVME_DEFAULTS["buffer_size"])
            host["host_buffers"] = host.get("host_buffers", 0) + k * count * size
    return replace(est, **gpu, **host)
