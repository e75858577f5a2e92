"""Hand the merged config to every rank, and keep a copy beside each run and checkpoint."""

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import yaml

from neox.config.errors import ConfigError
from neox.config.loader import load_dict
from neox.config.schema import NeoXConfig

ARG = "--neox_config"


def encode(cfg: NeoXConfig) -> str:
    """URL-safe base64 of the JSON config: one shell-safe argument, however odd the values."""
    payload = json.dumps(cfg.to_flat(explicit_only=True), separators=(",", ":"), sort_keys=True)
    return base64.urlsafe_b64encode(payload.encode()).decode()


def decode(blob: str) -> NeoXConfig:
    """Inverse of encode()."""
    flat = json.loads(base64.urlsafe_b64decode(blob.encode()))
    return load_dict(flat, source="launcher")


def config_from_argv(argv: Sequence[str]) -> Optional[NeoXConfig]:
    """The config handed over by deepy.py as `--neox_config <blob>`, or None when absent."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == ARG and i + 1 < len(argv):
            return decode(argv[i + 1])
        if arg.startswith(ARG + "="):
            return decode(arg.split("=", 1)[1])
    return None


def write_config(cfg: NeoXConfig, path: Path, extra: Optional[dict] = None) -> Path:
    """Write the config as YAML (all keys, so later default changes cannot alter a run)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = cfg.to_flat()
    data.update(extra or {})
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
    return path


def read_saved_config(path: Path) -> NeoXConfig:
    """Read a config written by write_config (e.g. from a checkpoint directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.yml"
    if not path.is_file():
        raise ConfigError(f"no saved config at {path}; pass the checkpoint directory neox wrote")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        reason = " ".join(str(e).split())[:200]
        raise ConfigError(
            f"{path} is not a readable neox config (not valid YAML: {reason}); fix or restore it"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} is not a readable neox config (a YAML {type(data).__name__}, not a mapping "
            "of config keys); fix or restore it"
        )
    return load_dict(data, source=str(path))
