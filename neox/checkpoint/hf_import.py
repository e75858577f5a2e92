"""Read a local Hugging Face GPTNeoX or Llama directory as neox config keys and weights.

The config keys are the inverse of hf_map.hf_config_for; anything the HF config holds that our
model cannot express (rope scaling, a head_dim other than hidden/heads, ...) is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from neox.checkpoint.consolidate import check_state_dict
from neox.checkpoint.hf_map import HF_ACTIVATIONS, check_exportable, from_hf_state_dict
from neox.checkpoint.staging import check_output_dir, staged_directory
from neox.checkpoint.writer import check_layout, write_checkpoint
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
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


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


def _weight_files(hf_dir: Path) -> list[Path]:
    for name in WEIGHT_FILES:
        if (hf_dir / name).is_file():
            return [hf_dir / name]
        index = hf_dir / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [hf_dir / s for s in shards]
    raise HFImportError(
        f"{hf_dir} has no weights: expected {' or '.join(WEIGHT_FILES)} (or a sharded "
        "*.index.json beside its shards)"
    )


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's (possibly sharded) safetensors or PyTorch weights."""
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(hf_dir)):
        if not path.is_file():
            raise HFImportError(f"{path} is listed in the weight index but missing")
        if path.suffix == ".safetensors":
            sd.update(load_file(str(path)))
        else:
            sd.update(torch.load(path, map_location="cpu", weights_only=True))
    return sd


def convert_from_hf(
    hf_dir: str | Path, output_dir: str | Path, tp: int = 1, pp: int = 1, overwrite: bool = False
) -> tuple[Path, Optional[str]]:
    """Write the HF model as a neox checkpoint at tp/pp in output_dir, with `model.yml` (the
    config keys to finetune it); returns that YAML's path and a note when the tokenizer could
    not be wired up."""
    hf_dir, out = Path(hf_dir), Path(output_dir)
    hf = read_hf_config(hf_dir)
    arch = hf.get("model_type")
    flat: dict[str, Any] = dict(neox_model_keys(hf), model_parallel_size=tp)
    if pp > 1:
        flat["pipe_parallel_size"] = pp
    note = None
    tokenizer = hf_dir / "tokenizer.json"
    try:
        build_tokenizer("HFTokenizer", str(tokenizer))
        flat.update(tokenizer_type="HFTokenizer", vocab_file=str(tokenizer.resolve()))
    except (ValueError, OSError) as e:
        note = f"no tokenizer keys written ({e}); set tokenizer_type and vocab_file yourself"
    # HF's rows exactly (rounded up to a multiple of tp): extra zero rows would change softmax.
    flat["padded_vocab_size"] = pad_vocab_size(hf["vocab_size"], 1, tp)
    flat.update(finetune=True, load=str(out.resolve()))
    try:
        cfg = load_dict(flat, source=str(hf_dir / "config.json"))
        check_exportable(cfg.model, arch)
    except (ConfigError, ValueError) as e:
        raise HFImportError(str(e)) from None
    check_layout(cfg, tp, pp)
    check_output_dir(out, overwrite, protected=[hf_dir])

    padded = flat["padded_vocab_size"]
    sd = from_hf_state_dict(read_hf_weights(hf_dir), cfg.model, padded, arch)
    check_state_dict(sd, build_model(cfg.model, padded, device="meta"), hf_dir)
    with staged_directory(out, overwrite) as tmp:
        write_checkpoint(sd, cfg, tmp, 0)
        (tmp / "model.yml").write_text(yaml.safe_dump(flat, sort_keys=False))
    return out / "model.yml", note
