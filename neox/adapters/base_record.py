"""The base a LoRA adapter checkpoint was trained on, recorded beside the adapter.

A LoRA run's checkpoints hold the adapters alone (and their optimizer state); `lora_base.json`
in each global_stepN directory names the base: the base checkpoint's global_stepN directory and
the sha256 of its manifest (which holds the checksum of every base file), or, for a run without
`lora_base`, the seed its base was initialised from. Resuming, generate/eval and export read
the base through it and refuse a base that changed since.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.manifest import MANIFEST
from neox.config import NeoXConfig

REFERENCE_FILE = "lora_base.json"


def manifest_sha256(tag_dir: Path) -> Optional[str]:
    path = tag_dir / MANIFEST
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def base_reference(
    cfg: NeoXConfig, base_dir: Optional[Path], padded_vocab_size: Optional[int]
) -> dict[str, Any]:
    """The reference a LoRA run on base checkpoint `base_dir` (None: initialised from `seed`)
    writes into its checkpoints."""
    lo = cfg.lora
    ref: dict[str, Any] = {
        "lora_rank": lo.lora_rank,
        "lora_alpha": lo.lora_alpha,
        "lora_target_modules": list(lo.lora_target_modules),
    }
    if base_dir is None:
        return dict(ref, init_seed=cfg.training.seed, padded_vocab_size=padded_vocab_size)
    base_dir = base_dir.resolve()
    return dict(ref, base=str(base_dir), manifest_sha256=manifest_sha256(base_dir))


def write_reference(step_dir: Path, reference: dict[str, Any]) -> None:
    (step_dir / REFERENCE_FILE).write_text(json.dumps(reference, indent=2) + "\n")


def read_reference(step_dir: Path) -> Optional[dict[str, Any]]:
    """The reference in a checkpoint directory, or None when it holds no adapter."""
    path = step_dir / REFERENCE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore it from a copy") from None


def base_problem(step_dir: Path, reference: dict[str, Any]) -> Optional[str]:
    """Why the base `reference` names cannot be used for the adapter in `step_dir`, or None."""
    if "base" not in reference:
        return None
    base = Path(reference["base"])
    if not base.is_dir():
        return (
            f"the adapter in {step_dir} was trained on base {base}, which no longer exists; "
            "restore the base checkpoint there"
        )
    now = manifest_sha256(base)
    if now != reference.get("manifest_sha256"):
        return (
            f"the adapter in {step_dir} was trained on base {base} with manifest sha256 "
            f"{reference.get('manifest_sha256')}, but the base there now has {now}: the base "
            "changed; restore the base the adapter was trained on"
        )
    return None
