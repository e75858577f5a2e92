"""Read a local Hugging Face model directory as neox config keys and weights, and write it as a
neox checkpoint at any TP/PP, one layer at a time.

The config keys are the inverse of hf_map.hf_config_for; a config.json field neox does not know
is refused by name, as is anything our model cannot express (neox_model_keys). The weights are
planned from the file headers (every name and shape checked against the model) before anything
is written, then read, converted and written layer by layer (hf_weights.py, stream_writer.py),
so host memory stays near one layer rather than the model. The tokenizer files, the generation
config and the chat template are carried into the checkpoint's `hf/` directory, and the family
into the config (hf_architecture), so convert_to_hf.py gives them back.
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
from neox.checkpoint.hf_map import HF_ACTIVATIONS, check_exportable, from_hf_state_dict
from neox.checkpoint.hf_weights import HFWeights, HFWeightsError
from neox.checkpoint.staging import check_output_dir, staged_directory
from neox.checkpoint.stream_writer import StreamingCheckpoint
from neox.checkpoint.writer import check_layout
from neox.config import ConfigError, load_dict, pad_vocab_size
from neox.model import build_model
from neox.tokenizer import build_tokenizer

# HF model_type -> hf_map's architecture name.
MODEL_TYPES = ("gpt_neox", "llama")
# HF hidden_act -> our `activation` (Llama's gated MLP applies it to the gate branch).
ACTIVATIONS = {
    "gpt_neox": {hf: ours for ours, hf in HF_ACTIVATIONS.items()},
    "llama": {"silu": "swiglu", "gelu": "geglu"},
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# HF model_type -> the name convert_to_hf.py's --architecture (and hf_architecture) use.
FAMILIES = {
    "gpt_neox": "neox",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}

# config.json fields that change no weight and no computation of the causal LM: provenance,
# transformers' run-time switches, the token ids of generation, other heads' labels. (The
# tokenizer and generation files carry the ids back on export.)
METADATA_FIELDS = frozenset(
    {
        "_name_or_path",
        "_attn_implementation",
        "_commit_hash",
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "model_type",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "id2label",
        "label2id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "classifier_dropout",  # the sequence-classification head's, not the LM's
        "tokenizer_class",
        "initializer_range",  # init only; kept as init_method_std
        "pretraining_tp",  # transformers < 5 splits the matmuls; same weights, same function
    }
)
_COMMON = {
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_dropout",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
}
_GQA = {"num_key_value_heads", "rms_norm_eps"}
_QWEN = {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}
# The fields of each family's config.json that neox_model_keys turns into model keys (or
# checks); any other field is refused by name, since neox cannot tell what it changes.
MODEL_FIELDS = {
    "gpt_neox": _COMMON
    | {
        "rotary_pct",
        "rotary_emb_base",
        "layer_norm_eps",
        "use_parallel_residual",
        "hidden_dropout",
        "attention_bias",
    },
    "llama": _COMMON | _GQA | {"attention_bias", "mlp_bias"},
    "mistral": _COMMON | _GQA | {"sliding_window"},
    "qwen2": _COMMON | _GQA | _QWEN | {"use_mrope"},
    "qwen3": _COMMON | _GQA | _QWEN | {"attention_bias"},
}

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
    return json.loads(path.read_text())


def _rope(hf: dict[str, Any]) -> tuple[float, float, str]:
    """(theta, partial rotary factor, rope type), from transformers 5's rope_parameters or
    the older top-level keys."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000)))
    partial = params.get(
        "partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", 1.0))
    )
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), float(partial), kind


def neox_model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """Our flat model config keys for an HF GPTNeoX / Llama config.json."""
    arch = hf.get("model_type")
    if arch not in MODEL_TYPES:
        raise HFImportError(
            f"model_type={arch!r} is not supported; convert_from_hf reads {', '.join(MODEL_TYPES)}"
        )
    theta, partial, rope_type = _rope(hf)
    heads = hf["num_attention_heads"]
    problems = []
    if rope_type != "default":
        problems.append(f"rope_type={rope_type!r} (only unscaled rotary is supported)")
    if theta != int(theta):
        problems.append(f"rope_theta={theta} (rotary_emb_base is an integer)")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        problems.append(f"head_dim={hf['head_dim']} (ours is hidden_size / num_attention_heads)")
    act = ACTIVATIONS[arch].get(hf.get("hidden_act", "silu" if arch == "llama" else "gelu"))
    if act is None:
        problems.append(
            f"hidden_act={hf.get('hidden_act')!r} (use one of {', '.join(ACTIVATIONS[arch])})"
        )
    if problems:
        raise HFImportError(f"this HF {arch} model cannot be read: " + "; ".join(problems))
    intermediate = hf["intermediate_size"]
    keys: dict[str, Any] = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "seq_length": hf["max_position_embeddings"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "pos_emb": "rotary",
        "rotary_pct": partial,
        "rotary_emb_base": int(theta),
        "activation": act,
        "no_weight_tying": not hf.get("tie_word_embeddings", False),
        "init_method_std": hf.get("initializer_range", 0.02),
        "attention_dropout": hf.get("attention_dropout", 0.0),
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
    else:
        keys.update(
            # Our gated width is int(intermediate_size * 2/3) // 2: 3x gives HF's exactly.
            intermediate_size=3 * intermediate,
            norm="rmsnorm",
            rms_norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            use_bias_in_attn_linear=hf.get("attention_bias", False),
            use_bias_in_mlp=hf.get("mlp_bias", False),
        )
    return keys


def check_hf_fields(hf: dict[str, Any]) -> None:
    """Refuse, by name, every config.json field neox does not know for this family, and the
    known ones set to values our model cannot express (mixed attention layer types, M-RoPE)."""
    family = hf.get("model_type")
    if family not in MODEL_FIELDS:
        raise HFImportError(
            f"model_type={family!r} is not supported; convert_from_hf reads "
            f"{', '.join(MODEL_FIELDS)}"
        )
    unknown = sorted(set(hf) - METADATA_FIELDS - MODEL_FIELDS[family])
    problems = [
        f"{k}={json.dumps(hf[k])[:60]} (not a field neox knows for HF {family}; it may change "
        "the model)"
        for k in unknown
    ]
    layer_types = hf.get("layer_types")
    if layer_types and len(set(layer_types)) > 1:
        problems.append(
            f"layer_types={sorted(set(layer_types))} (neox gives every layer the same attention)"
        )
    window_layers = hf.get("max_window_layers")
    if (
        hf.get("use_sliding_window")
        and window_layers is not None
        and window_layers < hf.get("num_hidden_layers", 0)
    ):
        problems.append(
            f"max_window_layers={window_layers} with use_sliding_window=true (sliding window "
            "on some layers only; neox gives every layer the same attention)"
        )
    if hf.get("use_mrope"):
        problems.append("use_mrope=true (multimodal rotary is not implemented)")
    if problems:
        raise HFImportError(
            f"this HF {family} config.json cannot be imported: " + "; ".join(problems)
        )


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
    """HF tensor names grouped for conversion: everything outside the blocks (embedding, final
    norm, head: converted together, as tying relates them), then one group per block."""
    blocks: dict[int, list[str]] = {}
    rest = []
    for name in names:
        m = LAYER.search(name)
        if m:
            blocks.setdefault(int(m.group(1)), []).append(name)
        else:
            rest.append(name)
    return [rest, *(blocks[i] for i in sorted(blocks))]


def _tokenizer_keys(hf_dir: Path, carried: Path) -> tuple[dict[str, Any], Optional[str]]:
    """HFTokenizer keys on the carried tokenizer.json, or a note why there are none."""
    source = hf_dir / "tokenizer.json"
    try:
        build_tokenizer("HFTokenizer", str(source))
    except (ValueError, OSError) as e:
        return {}, f"no tokenizer keys written ({e}); set tokenizer_type and vocab_file yourself"
    return {"tokenizer_type": "HFTokenizer", "vocab_file": str(carried / "tokenizer.json")}, None


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
    check_hf_fields(hf)
    family = hf["model_type"]
    arch = family  # hf_map's architecture names are HF's model_type
    carried = out.resolve() / CARRIED_DIR
    flat: dict[str, Any] = dict(neox_model_keys(hf), model_parallel_size=tp)
    if pp > 1:
        flat["pipe_parallel_size"] = pp
    tokenizer_keys, note = _tokenizer_keys(hf_dir, carried)
    flat.update(tokenizer_keys)
    # HF's rows exactly (rounded up to a multiple of tp): extra zero rows would change softmax.
    flat["padded_vocab_size"] = pad_vocab_size(hf["vocab_size"], 1, tp)
    flat.update(
        finetune=True,
        load=str(out.resolve()),
        hf_architecture=FAMILIES[family],
        hf_files=str(carried),
    )
    try:
        cfg = load_dict(flat, source=str(hf_dir / "config.json"))
        check_exportable(cfg.model, arch)
    except (ConfigError, ValueError) as e:
        raise HFImportError(str(e)) from None
    check_layout(cfg, tp, pp)
    check_output_dir(out, overwrite, protected=[hf_dir])

    # The plan: every converted name, shape and dtype, from the headers alone.
    padded = flat["padded_vocab_size"]
    weights = _weights(hf_dir)
    cast = DTYPES.get(dtype)
    try:
        layout = from_hf_state_dict(weights.meta(), cfg.model, padded, arch)
    except KeyError as e:
        raise HFImportError(f"{hf_dir}: {e.args[0]}") from None
    layout = {k: v.to(cast) if cast else v for k, v in layout.items()}
    check_state_dict(layout, build_model(cfg.model, padded, device="meta"), hf_dir)

    with staged_directory(out, overwrite) as tmp:
        writer = StreamingCheckpoint(cfg, tmp, layout)
        for names in layer_groups(list(weights.meta())):
            part = from_hf_state_dict(weights.read(names), cfg.model, padded, arch)
            for name in list(part):
                tensor = part.pop(name)
                writer.write(name, tensor.to(cast) if cast else tensor)
            del part
        writer.finish()
        (tmp / CARRIED_DIR).mkdir()
        for name in CARRIED_FILES:
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, tmp / CARRIED_DIR / name)
        (tmp / "model.yml").write_text(yaml.safe_dump(flat, sort_keys=False))
    return out / "model.yml", note
