"""Typed, layered run configuration (imports without torch, so `deepy.py --dry-run` is quick)."""

from neox.config.derived import Derived, derive, pad_vocab_size
from neox.config.ds_config import build_ds_config
from neox.config.errors import ConfigError
from neox.config.loader import LoadedConfig, load_config, load_dict
from neox.config.model import ModelConfig
from neox.config.schema import GROUPS, KEY_OWNER, NeoXConfig
from neox.config.transport import config_from_argv, decode, encode, read_saved_config, write_config

__all__ = [
    "GROUPS",
    "KEY_OWNER",
    "ConfigError",
    "Derived",
    "LoadedConfig",
    "ModelConfig",
    "NeoXConfig",
    "build_ds_config",
    "config_from_argv",
    "decode",
    "derive",
    "encode",
    "load_config",
    "load_dict",
    "pad_vocab_size",
    "read_saved_config",
    "write_config",
]
