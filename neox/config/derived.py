"""Values computed from the config, never read from YAML: model shape, layout, batch triple,
vocab, schedule. Everything else reads them from here rather than working them out again.

Every rule across keys lives here too (a rule on one key sits at its field): `check_model`
runs when a ModelConfig is validated (its shape depends on it) and carries the result as
`ModelConfig.shape`, which every other module reads; `check_config` runs when a NeoXConfig is
validated; the rules of a run (world size and layout, batch, precision, pipeline) run in `derive`,
and `Topology.validate` applies the same layout rules. The schema is imported for type hints only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

from neox.config.errors import ConfigError
from neox.config.optimizer import OPTIMIZER_TYPES

if TYPE_CHECKING:
    from neox.config.model import ModelConfig
    from neox.config.schema import NeoXConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Derived:
    """What a run computes once from its config and world size."""

    world_size: int
    tensor_parallel: int
    pipe_parallel: int
    data_parallel: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    precision: str  # "fp32" | "fp16" | "bf16"
    lr_decay_iters: int
    warmup_iters: int
    padded_vocab_size: Optional[int]
    optimizer_type: str  # lower case: adam, adamw, cpu_adam, sgd, lion...
    lr: float  # peak learning rate
    samples: tuple[int, int, int]  # train, valid, test samples the whole run draws
    zero_stage: int
    model: ModelShape

    def as_dict(self) -> dict:
        return asdict(self)


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


def model_shape(m: ModelConfig) -> ModelShape:
    """The ModelShape of `m`; raises ValueError for an attention_config that does not fit."""
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    max_positions = m.max_position_embeddings or m.seq_length
    dense_bias = m.use_bias_in_attn_dense
    return ModelShape(
        attn_dense_bias=m.use_bias_in_attn_linear if dense_bias is None else dense_bias,
        rope=rope_scaling(m, max_positions),
        head_dim=head_dim,
        kv_heads=m.num_kv_heads or m.num_attention_heads,
        ffn_size=_ffn_size(m),
        gated_mlp=m.activation in GATED_ACTIVATIONS,
        rotary_dims=int(head_dim * m.rotary_pct),
        max_positions=max_positions,
        position_rows=max_positions + m.opt_pos_emb_offset,
        layer_types=_layer_types(m),
    )


def rope_scaling(m: ModelConfig, max_positions: int) -> Optional[RopeScaling]:
    """The RoPE scaling the flat rope_* keys (or the rope_scaling mapping) ask for; raises
    ValueError naming the key when a value is missing, misplaced or contradictory."""
    flat = {key: getattr(m, key) for key in ("rope_scaling_type", *ROPE_SCALING_KEYS.values())}
    flat["rope_yarn_truncate"] = None if m.rope_yarn_truncate else False  # True is the default
    if m.rope_scaling is not None:
        if any(v is not None for v in flat.values()):
            given = ", ".join(f"{k}={v}" for k, v in flat.items() if v is not None)
            raise ValueError(
                f"rope_scaling={m.rope_scaling} and {given} are both set; keep one spelling"
            )
        flat = _flat_rope_keys(m.rope_scaling, m.rotary_emb_base)
    kind = flat["rope_scaling_type"]
    if kind is None:
        stray = [f"{k}={v}" for k, v in flat.items() if v is not None]
        if stray:
            raise ValueError(
                f"{', '.join(stray)} set without rope_scaling_type; set it or drop them"
            )
        return None
    if m.pos_emb != "rotary":
        raise ValueError(f"rope_scaling_type={kind!r} needs pos_emb=rotary (got {m.pos_emb!r})")
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


def _ffn_size(m: ModelConfig) -> int:
    """Inner width of the MLP (per branch for gated activations), as gpt-neox derives it."""
    if m.intermediate_size is not None:
        width = m.intermediate_size
    elif m.expansion_factor is not None:
        width = int(m.expansion_factor * m.hidden_size)
    else:
        width = 4 * m.hidden_size
    if m.activation in GATED_ACTIVATIONS:
        # Equal parameters to the ungated MLP: two branches of 2/3 of the width, halved.
        width = int(width * 2 / 3) // 2
    k = m.mlp_multiple_of
    return k * ((width + k - 1) // k)


def _layer_types(m: ModelConfig) -> tuple[str, ...]:
    """Attention type of each layer, expanded from attention_config (default: all global)."""
    if not m.attention_config:
        return ("global",) * m.num_layers
    types: list[str] = []
    for entry in m.attention_config:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise ValueError(
                f"attention_config entry {entry!r} must be [[types...], repeat], "
                'e.g. [["flash"], 24]'
            )
        kinds, repeat = entry
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if repeat == "all":  # gpt-neox: the pattern repeats over every layer
            repeat = m.num_layers // max(1, len(kinds))
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
    if len(types) != m.num_layers:
        raise ValueError(
            f"attention_config describes {len(types)} layers but num_layers={m.num_layers}; "
            f"make the repeats add up to {m.num_layers}"
        )
    return tuple(types)


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


def check_config(cfg: NeoXConfig) -> None:
    """Rules across keys of different groups, or of a group about its data sources and
    profiling (run when a NeoXConfig is validated; the run's own rules are in `derive`)."""
    d = cfg.data
    for name in ("train", "valid", "test"):
        paths = getattr(d, f"{name}_data_paths")
        weights = getattr(d, f"{name}_data_weights")
        if weights is not None and not any(weights):
            raise ValueError(f"{name}_data_weights={weights} are all zero; give one weight > 0")
        if weights is not None and (paths is None or len(weights) != len(paths)):
            raise ValueError(
                f"{name}_data_weights has {len(weights)} entries but {name}_data_paths has "
                f"{0 if paths is None else len(paths)}; give one weight per path"
            )
    for name in ("train", "valid", "test"):
        paths = getattr(d, f"{name}_data_paths")
        labels = getattr(d, f"{name}_label_data_paths")
        if labels is not None and (paths is None or len(labels) != len(paths)):
            raise ValueError(
                f"{name}_label_data_paths has {len(labels)} entries but {name}_data_paths has "
                f"{0 if paths is None else len(paths)}; give one label dataset per data path"
            )
    if d.label_data_paths and not d.data_path:
        raise ValueError(
            "label_data_paths is the label dataset of data_path, which is not set; with "
            "train/valid/test_data_paths use train/valid/test_label_data_paths"
        )
    if d.train_data_paths and d.data_path:
        raise ValueError(
            "data_path and train_data_paths are both set; use data_path (with split) or "
            "train/valid/test_data_paths, not both"
        )
    check_preference(cfg)
    lg = cfg.logging
    if lg.profile and not lg.profile_step_start <= lg.profile_step_stop:
        raise ValueError(
            f"profile_step_start={lg.profile_step_start} and profile_step_stop="
            f"{lg.profile_step_stop} must satisfy 1 <= start <= stop"
        )
    check_lora(cfg)
    check_activation_memory_budget(cfg)


def check_activation_memory_budget(cfg: NeoXConfig) -> None:
    """A budget below 1 selects what compiled blocks recompute: it needs torch_compile, and
    whole-block checkpointing off."""
    t = cfg.training
    if t.activation_memory_budget < 1 and t.torch_compile is False:
        raise ValueError(
            f"activation_memory_budget={t.activation_memory_budget} selects what compiled blocks "
            "recompute, but torch_compile is false; unset torch_compile (on for GPU runs) or "
            "use checkpoint_activations: true"
        )
    if t.activation_memory_budget < 1 and t.checkpoint_activations:
        raise ValueError(
            f"activation_memory_budget={t.activation_memory_budget} and checkpoint_activations: "
            "true both recompute activations (the whole block would be rerun, then part of it "
            "again); set checkpoint_activations: false to recompute selectively, or "
            "activation_memory_budget: 1 to rerun whole blocks"
        )


def check_lora(cfg: NeoXConfig) -> None:
    """LoRA's layouts and options: what neox/parallel/lora.py implements, the rest refused."""
    lo = cfg.lora
    if not lo.lora_rank:
        return
    if cfg.parallel.pp > 1:
        raise ValueError(
            f"lora_rank={lo.lora_rank} with pipe_parallel_size={cfg.parallel.pipe_parallel_size}: "
            "LoRA is not implemented with pipeline parallelism; set pipe_parallel_size to 1 "
            "(tensor and data parallelism work)"
        )
    if zero_stage_of(cfg) == 3:
        raise ValueError(
            f"lora_rank={lo.lora_rank} with zero_optimization.stage=3: LoRA is not implemented "
            "with ZeRO-3 (the optimizer holds only the adapters, so stage 1 or 2 saves the same "
            "memory); use stage 0-2"
        )
    if cfg.training.finetune:
        raise ValueError(
            "finetune: true with lora_rank > 0: LoRA reads its base from lora_base; set "
            "lora_base to the base checkpoint and leave finetune false (load/save hold the "
            "adapter, so a restart resumes it)"
        )
    if "gate" in lo.lora_target_modules and not cfg.model.shape.gated_mlp:
        raise ValueError(
            f"lora_target_modules names 'gate', but activation={cfg.model.activation!r} has no "
            "gate linear (only swiglu/geglu do); remove it"
        )
    if cfg.preference.train_impl != "normal":
        raise ValueError(
            f"lora_rank={lo.lora_rank} with train_impl={cfg.preference.train_impl!r}: LoRA is "
            "not implemented for preference training (its reference copy is the full model); "
            "set lora_rank to 0 or train_impl to normal"
        )
    if cfg.float8.fp8.enabled:
        raise ValueError(
            f"lora_rank={lo.lora_rank} with fp8.enabled: LoRA adapters on float8 linears are not "
            "implemented; set fp8.enabled to false or lora_rank to 0"
        )
    tp = cfg.parallel.model_parallel_size
    if lo.lora_dropout and cfg.model.attention_dropout and tp > 1:
        raise ValueError(
            f"lora_dropout={lo.lora_dropout} with attention_dropout="
            f"{cfg.model.attention_dropout} at model_parallel_size={tp}: attention then runs "
            "on each tensor-parallel rank's own random stream, so the replicated adapter input "
            "of query_key_value would be dropped differently per rank; set one of them to 0"
        )


PAIRED = ("dpo", "rm")
SPLITS = ("train", "valid", "test")


def check_preference(cfg: NeoXConfig) -> None:
    """train_impl against its data keys: DPO and RM read chosen/rejected pairs, KTO rewarded
    answers; a key of another train_impl is a mistake, named with the fix."""
    p, d = cfg.preference, cfg.data
    impl = p.train_impl
    fields = type(p).model_fields
    for key in sorted(p.model_fields_set):
        value, default = getattr(p, key), fields[key].default
        owner = "dpo" if key.startswith("dpo_") else "kto" if key.startswith("kto_") else None
        if key.startswith(("pos_", "neg_")):
            owner = "dpo or rm"
        elif key.endswith("_reward_data_paths"):
            owner = "kto"
        if owner and value != default and impl not in owner.split(" or "):
            feature = {"dpo": "DPO", "kto": "KTO", "dpo or rm": "DPO/RM pairwise data"}[owner]
            raise ValueError(
                f"{key}={value!r} asks for {feature} training but train_impl is {impl!r}; set "
                f"train_impl: {owner.split(' or ')[0]} or remove {key}"
            )
    if d.dataset_impl == "pairwise" and impl not in PAIRED:
        raise ValueError(
            f"dataset_impl='pairwise' is the chosen/rejected data of train_impl dpo or rm, but "
            f"train_impl is {impl!r}; set dataset_impl: gpt2"
        )
    if impl == "normal":
        return
    if cfg.parallel.pp > 1:
        raise ValueError(
            f"train_impl={impl!r} cannot run with pipe_parallel_size={cfg.parallel.pp}: its "
            "loss reads whole sequences' log-probabilities (and a reference model) at the last "
            "stage; use pipe_parallel_size 1 (tensor and data parallelism both work)"
        )
    if d.data_path:
        raise ValueError(
            f"train_impl={impl!r} reads per-split data paths, not data_path; set "
            + ("pos_/neg_train_data_paths" if impl in PAIRED else "train_data_paths")
        )
    for split in SPLITS:
        if impl in PAIRED:
            _check_paired(p, split, impl, d.train_data_paths if split == "train" else None)
        else:
            _check_rewarded(cfg, split)


def _paths(group: object, key: str) -> list[str]:
    return list(getattr(group, key) or [])


def _check_paired(p: object, split: str, impl: str, plain: Optional[list[str]]) -> None:
    pos, neg = _paths(p, f"pos_{split}_data_paths"), _paths(p, f"neg_{split}_data_paths")
    if split == "train" and not pos:
        raise ValueError(
            f"train_impl={impl!r} trains on chosen/rejected pairs: set pos_train_data_paths and "
            "neg_train_data_paths (preprocess_data_with_chat_template.py --jsonl-keys chosen "
            "rejected writes them)" + ("; train_data_paths is not read by it" if plain else "")
        )
    if len(pos) != len(neg):
        raise ValueError(
            f"pos_{split}_data_paths has {len(pos)} entries and neg_{split}_data_paths "
            f"{len(neg)}; give one rejected dataset per chosen one"
        )
    for side, data in (("pos", pos), ("neg", neg)):
        labels = _paths(p, f"{side}_{split}_label_data_paths")
        if labels and len(labels) != len(data):
            raise ValueError(
                f"{side}_{split}_label_data_paths has {len(labels)} entries and "
                f"{side}_{split}_data_paths {len(data)}; give one label file per dataset"
            )


def _check_rewarded(cfg: NeoXConfig, split: str) -> None:
    data = _paths(cfg.data, f"{split}_data_paths")
    rewards = _paths(cfg.preference, f"{split}_reward_data_paths")
    labels = _paths(cfg.data, f"{split}_label_data_paths")
    if split == "train" and not (data and rewards):
        raise ValueError(
            "train_impl='kto' trains on rewarded answers: set train_data_paths and "
            "train_reward_data_paths (preprocess_data_with_chat_template.py --reward-key writes "
            "them)"
        )
    if data and len(rewards) != len(data):
        raise ValueError(
            f"{split}_reward_data_paths has {len(rewards)} entries and {split}_data_paths "
            f"{len(data)}; KTO needs one reward file per dataset"
        )
    if labels and len(labels) != len(data):
        raise ValueError(
            f"{split}_label_data_paths has {len(labels)} entries and {split}_data_paths "
            f"{len(data)}; give one label file per dataset"
        )


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Round the vocabulary up so each tensor-parallel shard is a multiple of divisible_by."""
    multiple = divisible_by * tensor_parallel
    return multiple * math.ceil(vocab_size / multiple)


def padded_vocab(cfg: NeoXConfig, vocab_size: Optional[int]) -> Optional[int]:
    """Embedding rows of the model: padded_vocab_size, or the tokenizer's vocabulary padded
    (None when neither is known yet, as in a dry run without tokenizer files)."""
    padded = cfg.tokenizer.padded_vocab_size
    tp = cfg.parallel.model_parallel_size
    if vocab_size is not None:
        if padded is None:
            padded = pad_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
        elif padded < vocab_size:
            raise ConfigError(
                f"padded_vocab_size={padded} is smaller than the tokenizer's vocabulary "
                f"({vocab_size}); remove padded_vocab_size or raise it"
            )
    if padded is not None and padded % tp:
        raise ConfigError(
            f"padded_vocab_size={padded} is not divisible by model_parallel_size={tp}; "
            "remove padded_vocab_size to derive it"
        )
    return padded


def batch_triple(cfg: NeoXConfig, dp: int) -> tuple[int, int, int]:
    """(micro batch, accumulation steps, global batch): any two give the third."""
    t = cfg.training
    micro = t.train_micro_batch_size_per_gpu or t.batch_size
    gas, glob = t.gradient_accumulation_steps, t.train_batch_size
    dp_is = f"data-parallel size {dp}"
    if micro is not None and gas is not None and glob is not None:
        if micro * gas * dp != glob:
            raise ConfigError(
                f"train_batch_size={glob} != train_micro_batch_size_per_gpu={micro} x "
                f"gradient_accumulation_steps={gas} x data-parallel size {dp} = {micro * gas * dp}; "
                "set any two of the three and neox derives the third"
            )
    elif micro is not None and gas is not None:
        glob = micro * gas * dp
    elif micro is not None and glob is not None:
        gas = _exact_div(glob, micro * dp, f"train_micro_batch_size_per_gpu={micro} x {dp_is}")
    elif gas is not None and glob is not None:
        micro = _exact_div(glob, gas * dp, f"gradient_accumulation_steps={gas} x {dp_is}")
    elif micro is not None:
        gas, glob = 1, micro * dp
    elif glob is not None:
        gas = 1
        micro = _exact_div(glob, dp, dp_is)
    else:
        micro, gas = 1, gas or 1
        glob = micro * gas * dp
    for name, v in (("micro batch", micro), ("gradient_accumulation_steps", gas)):
        if v < 1:
            raise ConfigError(f"{name}={v} must be >= 1")
    return micro, gas, glob


def _exact_div(glob: int, part: int, part_is: str) -> int:
    if part == 0 or glob % part:
        raise ConfigError(
            f"train_batch_size={glob} is not divisible by {part_is} = {part}; set any two of "
            "train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps "
            "that fit, and neox derives the third"
        )
    return glob // part


def precision_of(cfg: NeoXConfig) -> str:
    """fp16, bf16 or fp32, from the DeepSpeed sections or gpt-neox's `precision`. An fp16
    section of `type: bfloat16` is gpt-neox's way of asking for bf16 (configs/pythia/1B.yml)."""
    p = cfg.precision
    fp16 = bool(p.fp16 and p.fp16.get("enabled", True))
    bf16 = bool(p.bf16 and p.bf16.get("enabled", True))
    if fp16 and p.fp16.get("type") in ("bfloat16", "bf16"):
        fp16, bf16 = False, True
    if fp16 and bf16:
        raise ConfigError("fp16 and bf16 are both enabled; enable one of them")
    from_sections = "fp16" if fp16 else "bf16" if bf16 else None
    named = {"bfloat16": "bf16"}.get(p.precision or "", p.precision)
    if named and from_sections and named != from_sections:
        raise ConfigError(
            f"precision={p.precision!r} contradicts the enabled {from_sections} section; "
            "keep them consistent or drop `precision`"
        )
    return from_sections or named or "fp32"


def zero_stage_of(cfg: NeoXConfig) -> int:
    """ZeRO stage: zero_optimization.stage, else gpt-neox's zero_stage shorthand, else 0."""
    ds = cfg.deepspeed
    return int((ds.zero_optimization or {}).get("stage", ds.zero_stage or 0))


def optimizer_type(cfg: NeoXConfig) -> str:
    """optimizer.type, or gpt-neox's flat optimizer_type when no `optimizer` section is given."""
    o = cfg.optimizer
    section = "optimizer" in o.model_fields_set
    if o.optimizer_type is None:
        return o.optimizer.type.lower()
    if section and o.optimizer_type.lower() != o.optimizer.type.lower():
        raise ConfigError(
            f"optimizer_type={o.optimizer_type!r} contradicts optimizer.type="
            f"{o.optimizer.type!r}; keep one of them"
        )
    kind = o.optimizer_type.lower()
    if kind not in OPTIMIZER_TYPES:
        raise ConfigError(
            f"optimizer_type={o.optimizer_type!r} is not available; use one of {OPTIMIZER_TYPES}"
        )
    return kind


def peak_lr(cfg: NeoXConfig) -> float:
    """gpt-neox's top-level `lr` wins over optimizer.params.lr."""
    o = cfg.optimizer
    return float(o.lr) if o.lr is not None else o.optimizer.lr


def sample_counts(cfg: NeoXConfig, global_batch: int) -> tuple[int, int, int]:
    """Samples of each split the run consumes, so the sample index is built once for all."""
    t = cfg.training
    # Every scheduled validation, and one more: the pass of an evaluation-only run.
    evals = validations_before(cfg, t.train_iters) + 1 if t.do_valid else 0
    return (
        t.train_iters * global_batch,
        evals * t.eval_iters * global_batch,
        t.eval_iters * global_batch if t.do_test else 0,
    )


def validations_before(cfg: NeoXConfig, iteration: int) -> int:
    """Validation passes in a run's first `iteration` steps (one each eval_interval)."""
    t = cfg.training
    return iteration // t.eval_interval if t.do_valid else 0


def consumed_samples(cfg: NeoXConfig, global_batch: int, iteration: int) -> tuple[int, int]:
    """(train, valid) samples drawn in the first `iteration` steps: where a resumed run's data
    streams continue."""
    valid = validations_before(cfg, iteration) * cfg.training.eval_iters * global_batch
    return iteration * global_batch, valid


def schedule_iters(cfg: NeoXConfig) -> tuple[int, int]:
    """(decay iterations, warmup iterations)."""
    o, iters = cfg.optimizer, cfg.training.train_iters
    if o.lr_decay_fraction is not None:
        decay = int(o.lr_decay_fraction * iters)
    else:
        decay = o.lr_decay_iters if o.lr_decay_iters is not None else iters
    return decay, int(o.warmup * decay)


def derive(cfg: NeoXConfig, world_size: int, vocab_size: Optional[int] = None) -> Derived:
    """Compute layout, batch, precision, schedule and padded vocab; raise ConfigError when off."""
    dp = check_layout(cfg, world_size)
    micro, gas, glob = batch_triple(cfg, dp)
    decay, warmup = schedule_iters(cfg)
    padded = padded_vocab(cfg, vocab_size)
    check_loss_scale(cfg, precision_of(cfg))
    check_float8(cfg, precision_of(cfg))
    check_pipeline_inputs(cfg)
    check_as_gpt_neox_does(cfg)
    check_fused_loss(cfg)
    samples = sample_counts(cfg, glob)
    check_split_sources(cfg, samples)
    check_preference_run(cfg, micro, samples)
    return Derived(
        world_size=world_size,
        tensor_parallel=cfg.parallel.model_parallel_size,
        pipe_parallel=cfg.parallel.pp,
        data_parallel=dp,
        micro_batch=micro,
        grad_accum=gas,
        global_batch=glob,
        precision=precision_of(cfg),
        lr_decay_iters=decay,
        warmup_iters=warmup,
        padded_vocab_size=padded,
        optimizer_type=optimizer_type(cfg),
        lr=peak_lr(cfg),
        samples=samples,
        zero_stage=zero_stage_of(cfg),
        model=cfg.model.shape,
    )


def check_layout(cfg: NeoXConfig, world_size: int) -> int:
    """World, heads, kv heads, MLP width and layers against the parallel sizes, every degree
    named; returns the data-parallel size."""
    tp, pp = cfg.parallel.model_parallel_size, cfg.parallel.pp
    dp = data_parallel_size(world_size, tp, pp)
    check_model_split(cfg.model, tp, pp)
    return dp


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else ds[0]


def data_parallel_size(world_size: int, tp: int = 1, pp: int = 1) -> int:
    """world_size / (tp * pp); raises ConfigError when the ranks do not divide evenly."""
    pp = max(1, pp)  # gpt-neox reads pipe_parallel_size=0 as "no pipeline"
    if tp < 1:
        raise ConfigError(f"model_parallel_size={tp} must be >= 1")
    if world_size < 1 or world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by model_parallel_size={tp} x "
            f"pipe_parallel_size={pp} = {tp * pp}; use a world size that is a multiple of "
            f"{tp * pp}, or choose model_parallel_size x pipe_parallel_size among the divisors "
            f"of {world_size} ({_divisors(world_size)})"
        )
    return world_size // (tp * pp)


def check_model_split(m: ModelConfig, tp: int, pp: int, source: str = "") -> None:
    """Raise ConfigError, naming the key and the fix, when the model cannot be cut into `tp`
    tensor-parallel shards and `pp` pipeline stages.

    Args:
        source: where the values came from (a config path), quoted in the messages.
    """
    where = f" ({source})" if source else ""
    heads, pp = m.num_attention_heads, max(1, pp)
    if heads % tp:
        raise ConfigError(
            f"num_attention_heads={heads} is not divisible by model_parallel_size={tp}{where}; "
            f"use model_parallel_size {_divisors(heads)}"
        )
    kv = m.shape.kv_heads
    if kv % tp:
        raise ConfigError(
            f"num_kv_heads={kv} is not divisible by model_parallel_size={tp}{where}; each "
            f"tensor-parallel rank needs whole key/value heads: use model_parallel_size "
            f"{_divisors(kv)}, or raise num_kv_heads"
        )
    ffn = m.shape.ffn_size
    if ffn % tp:
        raise ConfigError(
            f"the MLP width {ffn} (intermediate_size/expansion_factor) is not divisible by "
            f"model_parallel_size={tp}{where}; use model_parallel_size {_divisors(ffn)} or "
            f"set mlp_multiple_of to a multiple of {tp}"
        )
    if m.num_layers < pp:
        raise ConfigError(
            f"num_layers={m.num_layers} is smaller than pipe_parallel_size={pp}{where}; "
            f"every stage needs a block: use pipe_parallel_size <= {m.num_layers}"
        )


def check_float8(cfg: NeoXConfig, precision: str) -> None:
    """FP8 (neox/parallel/float8.py) converts the plain model's linears: bf16 or fp32 master
    precision, no pipeline (its stages are built apart, neox/parallel/pipeline.py), and the
    output layer only where the model's own head computes the logits (no chunked loss)."""
    if not cfg.float8.fp8.enabled:
        return
    if precision == "fp16":
        raise ConfigError(
            "fp8.enabled with fp16: torchao's float8 training runs beside bf16 or fp32, not "
            "fp16 loss scaling; set bf16: {enabled: true} (precision: bfloat16)"
        )
    if cfg.parallel.pp > 1:
        raise ConfigError(
            f"fp8.enabled with pipe_parallel_size={cfg.parallel.pp}: FP8 is applied to the "
            "plain model, not to pipeline stages; use pipe_parallel_size 1 (tensor or data "
            "parallelism) or set fp8.enabled: false"
        )
    chunk = cfg.model.lm_loss_chunk_size
    if cfg.float8.fp8.output_layer and chunk:
        raise ConfigError(
            f"fp8.output_layer with lm_loss_chunk_size={chunk}: the chunked loss computes the "
            "output layer in its own bf16 matmul; set lm_loss_chunk_size: 0 or "
            "fp8.output_layer: false"
        )


def check_loss_scale(cfg: NeoXConfig, precision: str) -> None:
    """fp16's dynamic_loss_scale against a static loss scale (gpt-neox's two spellings)."""
    p = cfg.precision
    static = p.loss_scale or (p.fp16 or {}).get("loss_scale")
    if precision != "fp16":
        return
    if p.dynamic_loss_scale and static:
        raise ConfigError(
            f"dynamic_loss_scale=true contradicts a static loss_scale={static}; drop one of them"
        )
    if p.dynamic_loss_scale is False and not static:
        raise ConfigError(
            "dynamic_loss_scale=false needs a static loss scale; set loss_scale (e.g. 1024) "
            "or drop dynamic_loss_scale"
        )


def check_as_gpt_neox_does(cfg: NeoXConfig) -> None:
    """Combinations gpt-neox's own validation refuses (NeoXArgs.validate_values)."""
    lr, min_lr = peak_lr(cfg), cfg.optimizer.min_lr
    if min_lr > lr:
        raise ConfigError(
            f"min_lr={min_lr} exceeds the peak learning rate {lr}; lower min_lr or raise lr"
        )


def check_fused_loss(cfg: NeoXConfig) -> None:
    """The chunked output-layer loss runs on the plain model's whole vocabulary only."""
    chunk, tp, pp = cfg.model.lm_loss_chunk_size, cfg.parallel.model_parallel_size, cfg.parallel.pp
    if chunk < 0:
        raise ConfigError(f"lm_loss_chunk_size={chunk} must be >= 0 (0: full logits)")
    if chunk and (tp > 1 or pp > 1):
        raise ConfigError(
            f"lm_loss_chunk_size={chunk} needs model_parallel_size=1 and pipe_parallel_size=1 "
            f"(got {tp} and {pp}); set lm_loss_chunk_size 0 for this layout"
        )


def check_split_sources(cfg: NeoXConfig, samples: tuple[int, int, int]) -> None:
    """Per-split data paths cover every split the run draws samples from (gpt-neox asks for all
    three), so the ranks never find a split missing after launch."""
    d = cfg.data
    if d.data_path or not d.train_data_paths:
        return
    off = {"valid": "do_valid: false (or eval_iters: 0)", "test": "do_test: false"}
    for name, n in zip(("valid", "test"), samples[1:]):
        if n and not getattr(d, f"{name}_data_paths"):
            raise ConfigError(
                f"train_data_paths is set but {name}_data_paths is not, and the run evaluates "
                f"{n} {name} samples; add {name}_data_paths (gpt-neox requires all three) or "
                f"set {off[name]}"
            )


def check_preference_run(cfg: NeoXConfig, micro: int, samples: tuple[int, int, int]) -> None:
    """KTO estimates its KL term from the other half of each micro-batch; paired data covers
    every split the run evaluates on."""
    impl = cfg.preference.train_impl
    if impl == "kto" and micro < 2:
        raise ConfigError(
            f"train_impl='kto' needs train_micro_batch_size_per_gpu >= 2 (got {micro}): each "
            "half of a micro-batch is the other's KL baseline"
        )
    p = cfg.preference
    reference = impl == "kto" or (impl == "dpo" and not p.dpo_reference_free)
    if reference and zero_stage_of(cfg) == 3:
        raise ConfigError(
            f"train_impl={impl!r} with ZeRO stage 3: the frozen reference copy is taken from "
            "whole weights, which ZeRO-3 partitions; use ZeRO stage 1 or 2 (or "
            "dpo_reference_free: true)"
        )
    if impl not in PAIRED:
        return
    off = {"valid": "do_valid: false (or eval_iters: 0)", "test": "do_test: false"}
    for name, n in zip(("valid", "test"), samples[1:]):
        if n and not getattr(cfg.preference, f"pos_{name}_data_paths"):
            raise ConfigError(
                f"train_impl={impl!r} evaluates {n} {name} samples but pos_{name}_data_paths is "
                f"not set; add pos_/neg_{name}_data_paths or set {off[name]}"
            )


def check_pipeline_inputs(cfg: NeoXConfig) -> None:
    """Pipeline stages pass hidden states only: no per-document positions or masks."""
    d = cfg.data
    asked = [k for k in ("reset_position_ids", "reset_attention_mask") if getattr(d, k)]
    if cfg.parallel.pp > 1 and asked:
        raise ConfigError(
            f"{' and '.join(asked)} cannot be used with pipe_parallel_size={cfg.parallel.pp} "
            "(pipeline stages pass hidden states only); turn them off or use pipe_parallel_size 1"
        )
