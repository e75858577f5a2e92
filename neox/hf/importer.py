"""Read a local Hugging Face model directory (GPTNeoX, Llama, Mistral, Qwen2, Qwen3, Mixtral,
Qwen3-MoE, Qwen2-MoE, OLMoE) as neox
config keys and weights, and write it as a neox checkpoint at any TP/PP, one layer at a time.

The config keys are the inverse of hf_map.hf_config_for; any config.json field our model cannot
express (longrope, an unknown field, ...) is refused by name before anything is written
(neox_model_keys). The weights are planned from the file headers (every name and shape checked
against the model) before anything is written, then read, converted and written layer by layer
(hf_weights.py, stream_writer.py), so host memory stays near one layer rather than the model.
The tokenizer files, the generation config and the chat template are carried into the
checkpoint's `hf/` directory, and the family into the config (hf_architecture), so
convert_to_hf.py gives them back.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from neox.checkpoint.consolidate import check_state_dict
from neox.checkpoint.staging import check_output_dir, staged_directory
from neox.checkpoint.stream_writer import StreamingCheckpoint
from neox.checkpoint.writer import VOCAB_MODULES, check_layout
from neox.config import ConfigError, load_dict, pad_vocab_size
from neox.config.shape import ROPE_SCALING_KEYS
from neox.config.shape import ROPE_TYPES as SCALING_TYPES
from neox.hf.mapping import (
    ARCH_NAMES,
    ARCHS,
    HF_ACTIVATIONS,
    HF_ALIASES,
    HF_IGNORED,
    HF_KEYS,
    LLAMA_FAMILY,
    check_exportable,
    from_hf_state_dict,
)
from neox.hf.moe_mapping import ATTENTION_ARCH, MOE_ARCHS, neox_moe_keys
from neox.hf.moe_mapping import READ_FIELDS as MOE_FIELDS
from neox.hf.weights import HFWeights, HFWeightsError
from neox.model import build_model
from neox.tokenizer import build_tokenizer

# HF model_type -> hf_map's architecture name (the same words).
MODEL_TYPES = ARCHS
# HF hidden_act -> our `activation` (the Llama family's gated MLP applies it to the gate branch).
ACTIVATIONS = {
    "gpt_neox": {hf: ours for ours, hf in HF_ACTIVATIONS.items()},
    **{arch: {"silu": "swiglu", "gelu": "geglu"} for arch in LLAMA_FAMILY},
}
# config.json fields that change nothing the weights compute (bookkeeping, generation, heads
# other than the causal LM's).
NEUTRAL_FIELDS = {
    "_name_or_path",
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "is_decoder",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
    "classifier_dropout",
    "pretraining_tp",  # transformers 5 ignores it; its slicing never changed the math
    "output_router_logits",  # MoE: whether forward also returns the router's logits
}
_LLAMA_FIELDS = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "attention_dropout",
}
_QWEN_WINDOW = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
# The fields neox_model_keys reads, per model_type; any other field is refused by name.
READ_FIELDS = {
    "gpt_neox": {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "layer_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_scaling",
        "rotary_pct",
        "rotary_emb_base",
        "partial_rotary_factor",
        "use_parallel_residual",
        "hidden_dropout",
        "attention_dropout",
        "attention_bias",
    },
    "llama": _LLAMA_FIELDS | {"attention_bias", "mlp_bias"},
    "mistral": _LLAMA_FIELDS | {"sliding_window"},
    "qwen2": _LLAMA_FIELDS | _QWEN_WINDOW,
    "qwen3": _LLAMA_FIELDS | _QWEN_WINDOW | {"attention_bias"},
    "mixtral": _LLAMA_FIELDS | {"sliding_window"} | MOE_FIELDS["mixtral"],
    "qwen3_moe": _LLAMA_FIELDS
    | {"use_sliding_window", "sliding_window", "max_window_layers", "attention_bias"}
    | MOE_FIELDS["qwen3_moe"],
    "qwen2_moe": _LLAMA_FIELDS | _QWEN_WINDOW | MOE_FIELDS["qwen2_moe"],
    "olmoe": _LLAMA_FIELDS | MOE_FIELDS["olmoe"],
}
# transformers' rope_type values neox reads ("default": no scaling).
ROPE_TYPES = ("default", *SCALING_TYPES)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# Files of an HF model directory besides config.json and the weights, carried into the
# checkpoint's hf/ directory and written back on export.
CARRIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
CARRIED_DIR = "hf"

LAYER = re.compile(r"\.layers\.(\d+)\.")


class HFImportError(ValueError):
    """The HF directory cannot be read as a neox model; the message says why and what to do."""


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFImportError(
            f"{hf_dir} has no config.json; pass a local Hugging Face model directory "
            "(config.json plus model.safetensors or pytorch_model.bin)"
        )
    try:
        hf = json.loads(path.read_text())
    except ValueError as e:
        raise HFImportError(
            f"{path} is not valid JSON ({e}); restore it from the model's download"
        ) from None
    if not isinstance(hf, dict):
        raise HFImportError(
            f"{path} holds a JSON {type(hf).__name__}, not an object of config fields; restore "
            "it from the model's download"
        )
    return hf


# config.json's sizes, read by every family: each must be a positive integer.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


def _bad_sizes(hf: dict[str, Any]) -> list[str]:
    """The size fields that are missing or not positive integers (num_key_value_heads and
    head_dim may also be absent or null)."""

    def size(v: Any) -> bool:
        return type(v) is int and v > 0

    bad = [f"{k} missing" for k in SIZE_FIELDS if k not in hf]
    bad += [f"{k}={hf[k]!r}" for k in SIZE_FIELDS if k in hf and not size(hf[k])]
    bad += [
        f"{k}={hf[k]!r}"
        for k in ("num_key_value_heads", "head_dim")
        if hf.get(k) is not None and not size(hf[k])
    ]
    return bad


def _rope(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """Our rotary keys (base, rotary_pct, rope_* scaling) from transformers 5's
    rope_parameters or the older rope_scaling / top-level keys; problems are appended."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000)))
    partial = params.pop(
        "partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", 1.0))
    )
    kind = params.pop("rope_type", params.pop("type", "default"))
    keys: dict[str, Any] = {"rotary_pct": float(partial)}
    if float(theta) != int(float(theta)):
        problems.append(f"rope_theta={theta} (rotary_emb_base is an integer)")
    else:
        keys["rotary_emb_base"] = int(float(theta))
    if kind not in ROPE_TYPES:
        problems.append(f"rope_type={kind!r} (neox implements {', '.join(ROPE_TYPES)})")
        return keys
    unknown = sorted(k for k in params if k not in ROPE_SCALING_KEYS)
    if unknown:
        problems.append(f"rope_parameters field(s) {unknown} (not used by rope_type={kind!r})")
    if kind == "default":
        if any(v is not None for k, v in params.items() if k in ROPE_SCALING_KEYS):
            problems.append(f"rope_parameters {params} with rope_type='default'")
        return keys
    keys["rope_scaling_type"] = kind
    for field, flat in ROPE_SCALING_KEYS.items():
        value = params.get(field)
        if field == "truncate":
            if value is False:
                keys[flat] = False
        elif value is not None:
            keys[flat] = value
    if kind in ("llama3", "yarn"):
        # transformers' default for the pretraining length.
        keys.setdefault("rope_original_max_position_embeddings", hf["max_position_embeddings"])
    if kind in ("linear", "dynamic"):
        keys.pop("rope_original_max_position_embeddings", None)  # transformers ignores it here
    return keys


def _windows(hf: dict[str, Any], arch: str, problems: list[str]) -> dict[str, Any]:
    """sliding_window_width (and attention_config for Qwen's mixed layers). HF counts the query
    among the window's keys: HF sliding_window N is our width N - 1."""
    n = hf["num_hidden_layers"]
    if arch == "mistral":
        sliding = [True] * n if hf.get("sliding_window") is not None else [False] * n
    elif arch in ("qwen2", "qwen3"):
        on = hf.get("use_sliding_window", False)
        types = hf.get("layer_types")
        if types is None:
            first = hf.get("max_window_layers", 28)
            types = [
                "sliding_attention" if on and i >= first else "full_attention" for i in range(n)
            ]
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != n:
            problems.append(f"layer_types={types} (give one of full/sliding_attention per layer)")
            return {}
        sliding = [t == "sliding_attention" for t in types]
        if any(sliding) and not on:
            problems.append("layer_types with sliding_attention but use_sliding_window=false")
            return {}
    else:
        return {}
    if not any(sliding):
        return {}
    window = hf.get("sliding_window")
    if not isinstance(window, int) or window < 2:
        problems.append(f"sliding_window={window!r} (a window of at least 2 keys)")
        return {}
    keys: dict[str, Any] = {"sliding_window_width": window - 1}
    if not all(sliding):
        runs: list[list[Any]] = []
        for s in sliding:
            kind = "local" if s else "global"
            if runs and runs[-1][0] == [kind]:
                runs[-1][1] += 1
            else:
                runs.append([[kind], 1])
        keys["attention_config"] = runs
    return keys


def neox_model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """Our flat model config keys for an HF config.json of a family in hf_map.ARCHS; raises
    HFImportError naming every field that neox cannot express or does not know."""
    arch = hf.get("model_type")
    if arch not in MODEL_TYPES:
        raise HFImportError(
            f"model_type={arch!r} is not supported; convert_from_hf reads {', '.join(MODEL_TYPES)}"
        )
    if bad := _bad_sizes(hf):
        raise HFImportError(
            f"config.json's sizes must be positive integers: {', '.join(bad)}; restore "
            "config.json from the model's download"
        )
    problems = [
        f"unknown field {k}={hf[k]!r} (neox does not know what it changes)"
        for k in sorted(set(hf) - READ_FIELDS[arch] - NEUTRAL_FIELDS)
    ]
    heads = hf["num_attention_heads"]
    family = arch
    moe = neox_moe_keys(hf, arch, problems) if arch in MOE_ARCHS else {}
    # Mixtral's attention is Mistral's, Qwen*-MoE's Qwen*'s (their windows: neox_moe_keys).
    arch = ATTENTION_ARCH.get(arch, arch)
    rope = _rope(hf, problems)
    llama = arch in LLAMA_FAMILY
    act = ACTIVATIONS[arch].get(hf.get("hidden_act", "silu" if llama else "gelu"))
    if act is None:
        problems.append(
            f"hidden_act={hf.get('hidden_act')!r} (use one of {', '.join(ACTIVATIONS[arch])})"
        )
    head_dim = hf.get("head_dim")
    if arch == "gpt_neox" and head_dim not in (None, hf["hidden_size"] // heads):
        problems.append(f"head_dim={head_dim} (GPTNeoX's is hidden_size / num_attention_heads)")
    windows = {} if family in ("qwen3_moe", "qwen2_moe", "olmoe") else _windows(hf, arch, problems)
    if problems:
        raise HFImportError(f"this HF {family} model cannot be read: " + "; ".join(problems))
    intermediate = hf["intermediate_size"]
    keys: dict[str, Any] = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "seq_length": hf["max_position_embeddings"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "pos_emb": "rotary",
        **rope,
        "activation": act,
        "no_weight_tying": not hf.get("tie_word_embeddings", False),
        "init_method_std": hf.get("initializer_range", 0.02),
        "attention_dropout": hf.get("attention_dropout", 0.0),
        **windows,
        **moe,
    }
    if arch == "gpt_neox":
        keys.update(
            intermediate_size=intermediate,
            norm="layernorm",
            layernorm_epsilon=hf.get("layer_norm_eps", 1e-5),
            gpt_j_residual=hf.get("use_parallel_residual", True),
            hidden_dropout=hf.get("hidden_dropout", 0.0),
            use_bias_in_attn_linear=hf.get("attention_bias", True),
        )
        return keys
    keys.update(
        # Our gated width is int(intermediate_size * 2/3) // 2: 3x gives HF's exactly.
        intermediate_size=3 * intermediate,
        norm="rmsnorm",
        rms_norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        use_bias_in_attn_linear=hf.get("attention_bias", False),
        use_bias_in_mlp=hf.get("mlp_bias", False),
    )
    if head_dim is not None and head_dim * heads != hf["hidden_size"]:
        keys["head_dim"] = head_dim
    if arch == "qwen2":  # q/k/v biases, none on the output, always
        keys.update(use_bias_in_attn_linear=True, use_bias_in_attn_dense=False)
    if arch == "qwen3":
        keys["use_qk_layernorm"] = True
    return keys


# Fields that change nothing at these values but that neox_model_keys does not list (Qwen2.5's
# config.json has use_mrope: false): dropped before it reads the config.
NEUTRAL_VALUES = {"use_mrope": False}


def without_neutral_values(hf: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in hf.items() if not (k in NEUTRAL_VALUES and v == NEUTRAL_VALUES[k])}


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's (possibly sharded) safetensors or PyTorch weights."""
    weights = _weights(Path(hf_dir))
    return weights.read(weights.meta())


def _weights(hf_dir: Path) -> HFWeights:
    try:
        return HFWeights(hf_dir)
    except HFWeightsError as e:
        raise HFImportError(str(e)) from None


def layer_groups(names: list[str]) -> list[list[str]]:
    """HF tensor names grouped for conversion: each tensor outside the blocks alone (embedding,
    final norm, head: the largest tensors), then one group per block (q, k, v fuse)."""
    blocks: dict[int, list[str]] = {}
    rest = []
    for name in names:
        m = LAYER.search(name)
        if m:
            blocks.setdefault(int(m.group(1)), []).append(name)
        else:
            rest.append([name])
    return [*rest, *(blocks[i] for i in sorted(blocks))]


def check_weight_dtypes(meta: dict[str, torch.Tensor], hf_dir: Path, cast: bool) -> None:
    """Floating-point weights only, of one dtype unless they are cast to one (a mix is a file
    from another download, or a partly quantized model)."""
    weights = {n: t.dtype for n, t in meta.items() if not HF_IGNORED.search(n)}
    other = sorted(n for n, d in weights.items() if not d.is_floating_point)
    if other:
        raise HFImportError(
            f"{hf_dir}: {len(other)} tensor(s) are not floating point ({other[0]} is "
            f"{weights[other[0]]}); neox imports unquantized fp32, bf16 or fp16 models"
        )
    first: dict[str, str] = {}  # dtype -> the first tensor of it
    for name, dtype in weights.items():
        first.setdefault(str(dtype).removeprefix("torch."), name)
    if len(first) > 1 and not cast:
        names = ", ".join(f"{name} is {dtype}" for dtype, name in sorted(first.items()))
        raise HFImportError(
            f"{hf_dir}'s weights mix dtypes ({names}); pass --dtype fp32, bf16 or fp16 to "
            "write them all in one"
        )


def check_vocab_rows(
    meta: dict[str, torch.Tensor], vocab_size: int, arch: str, hf_dir: Path
) -> None:
    """The embedding and head must have config.json's vocab_size rows, as transformers requires
    (neox would otherwise pad or cut them silently)."""
    modules = {HF_KEYS[arch][m] for m in VOCAB_MODULES}
    aliases = HF_ALIASES.get(arch, {})
    for name, tensor in meta.items():
        module = name.rsplit(".", 1)[0]
        if aliases.get(module, module) in modules and tensor.shape[0] != vocab_size:
            raise HFImportError(
                f"{hf_dir}: {name} has {tensor.shape[0]} rows but config.json's vocab_size is "
                f"{vocab_size}; config.json and the weights come from different models"
            )


def check_carried_json(hf_dir: Path) -> None:
    """The JSON files carried into the checkpoint must parse (the export writes them back)."""
    for name in CARRIED_FILES:
        path = hf_dir / name
        if name.endswith(".json") and path.is_file():
            try:
                json.loads(path.read_text())
            except ValueError as e:
                raise HFImportError(
                    f"{path} is not valid JSON ({e}); restore it from the model's download, "
                    "or remove it"
                ) from None


def write_converted(
    writer: StreamingCheckpoint,
    weights: HFWeights,
    cfg: Any,
    padded: int,
    arch: str,
    cast: Optional[torch.dtype],
) -> None:
    """Convert and write the weights group by group; an untied model from a tied HF checkpoint
    (no head in the files) gets the embedding as its head, as from_hf_state_dict gives it."""
    embedding: list[str] = []
    for names in layer_groups(list(weights.meta())):
        part = from_hf_state_dict(
            weights.read(names), cfg.model, padded, arch, fill_untied_head=False
        )
        if "embed_in.weight" in part:
            embedding = names
        for name in list(part):
            tensor = part.pop(name)
            writer.write(name, tensor.to(cast) if cast else tensor)
        del part
    if ("embed_out.weight", 0) in writer.places and ("embed_out.weight", 0) not in writer.written:
        head = from_hf_state_dict(weights.read(embedding), cfg.model, padded, arch)[
            "embed_out.weight"
        ]
        writer.write("embed_out.weight", head.to(cast) if cast else head)


def _tokenizer_keys(hf_dir: Path, carried: Path) -> tuple[dict[str, Any], Optional[str]]:
    """HFTokenizer keys on the carried tokenizer.json, or a note why there are none."""
    source = hf_dir / "tokenizer.json"
    try:
        build_tokenizer("HFTokenizer", str(source))
    except (ValueError, OSError) as e:
        return {}, f"no tokenizer keys written ({e}); set tokenizer_type and vocab_file yourself"
    return {"tokenizer_type": "HFTokenizer", "vocab_file": str(carried / "tokenizer.json")}, None


def hf_source(hf_dir: Path) -> str:
    """The imported model's name: the hub name of a Hugging Face cache snapshot
    (.../models--org--name/snapshots/<revision>), else the directory's absolute path."""
    path = hf_dir.resolve()
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return str(path)


def convert_from_hf(
    hf_dir: str | Path,
    output_dir: str | Path,
    tp: int = 1,
    pp: int = 1,
    overwrite: bool = False,
    dtype: str = "auto",
) -> tuple[Path, Optional[str]]:
    """Write the HF model as a neox checkpoint at tp/pp in output_dir, with `model.yml` (the
    config keys to finetune it); returns that YAML's path and a note when the tokenizer could
    not be wired up. `dtype` (auto: as stored) is the written weights' dtype.

    Every refusal (config fields, tokenizer, layout, weight names and shapes, output
    directory) happens before anything is written."""
    hf_dir, out = Path(hf_dir), Path(output_dir)
    if dtype != "auto" and dtype not in DTYPES:
        raise HFImportError(f"dtype={dtype!r} is not one of auto, {', '.join(DTYPES)}")
    hf = read_hf_config(hf_dir)
    flat: dict[str, Any] = dict(neox_model_keys(without_neutral_values(hf)))
    family = hf["model_type"]
    arch = family  # hf_map's architecture names are HF's model_type
    carried = out.resolve() / CARRIED_DIR
    flat["model_parallel_size"] = tp
    if pp > 1:
        flat["pipe_parallel_size"] = pp
    tokenizer_keys, note = _tokenizer_keys(hf_dir, carried)
    flat.update(tokenizer_keys)
    # HF's rows exactly (rounded up to a multiple of tp): extra zero rows would change softmax.
    flat["padded_vocab_size"] = pad_vocab_size(hf["vocab_size"], 1, tp)
    flat.update(
        finetune=True,
        load=str(out.resolve()),
        hf_architecture=ARCH_NAMES[family],
        hf_files=str(carried),
        hf_source=hf_source(hf_dir),
    )
    try:
        cfg = load_dict(flat, source=str(hf_dir / "config.json"))
        check_exportable(cfg.model, arch)
        cfg.model.check_run(tp, pp)  # the model's layout rules (MoE, whole-projection q/k norms)
    except (ConfigError, ValueError) as e:
        raise HFImportError(str(e)) from None
    check_layout(cfg, tp, pp)
    check_carried_json(hf_dir)
    check_output_dir(out, overwrite, protected=[hf_dir])

    # The plan: every converted name, shape and dtype, from the headers alone.
    padded = flat["padded_vocab_size"]
    weights = _weights(hf_dir)
    cast = DTYPES.get(dtype)
    meta = weights.meta()
    check_weight_dtypes(meta, hf_dir, cast is not None)
    check_vocab_rows(meta, hf["vocab_size"], arch, hf_dir)
    try:
        layout = from_hf_state_dict(meta, cfg.model, padded, arch)
    except KeyError as e:
        raise HFImportError(f"{hf_dir}: {e.args[0]}") from None
    layout = {k: v.to(cast) if cast else v for k, v in layout.items()}
    check_state_dict(
        layout,
        build_model(cfg.model, padded, device="meta"),
        hf_dir,
        described_by="config.json",
        hint="are config.json and the weights from the same model?",
    )

    with staged_directory(out, overwrite) as tmp:
        writer = StreamingCheckpoint(cfg, tmp, layout)
        write_converted(writer, weights, cfg, padded, arch, cast)
        writer.finish()
        (tmp / CARRIED_DIR).mkdir()
        for name in CARRIED_FILES:
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, tmp / CARRIED_DIR / name)
        (tmp / "model.yml").write_text(yaml.safe_dump(flat, sort_keys=False))
    return out / "model.yml", note
