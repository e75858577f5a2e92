"""Read YAML/JSON config files, merge them in order, and validate the result into a NeoXConfig."""

import difflib
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from neox.config.errors import ConfigError
from neox.config.schema import GROUPS, KEY_OWNER, NeoXConfig
from neox.config.unsupported import RUNTIME_KEYS, is_inert, unsupported_feature

log = logging.getLogger(__name__)

FIELDS = {k: f for cls in GROUPS.values() for k, f in cls.model_fields.items()}


# A config is a few hundred nodes; aliases past these bounds are a "billion laughs" document,
# refused before anything expands it (PyYAML shares aliased nodes, repr and merging do not).
MAX_ALIASES = 1000
MAX_EXPANDED_NODES = 100_000


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-5` as a float (YAML 1.1 wants `1.0e-5`), and refuses
    aliases past MAX_ALIASES or expanding past MAX_EXPANDED_NODES."""

    aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise ConfigError(
                    f"more than {MAX_ALIASES} YAML aliases (*name); write the values out"
                )
        return super().compose_node(parent, index)

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node)
        return self.construct_document(node)


def _check_expanded_size(root: yaml.Node) -> None:
    """Count the nodes the document becomes once every alias is expanded, each shared node
    counted once per use (memoised, so the count itself stays cheap)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = MAX_EXPANDED_NODES + 1  # a cycle (an alias inside its anchor)
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        total = 1
        for child in children:
            total = min(total + size(child), MAX_EXPANDED_NODES + 1)
        sizes[id(node)] = total
        return total

    if size(root) > MAX_EXPANDED_NODES:
        raise ConfigError(
            f"its YAML aliases expand to more than {MAX_EXPANDED_NODES:,} values; a config is "
            "a few hundred: write the values out instead of nesting aliases"
        )


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[0-9][0-9_]*[eE][-+]?[0-9]+
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _mapping_without_duplicates(loader: _Loader, node: yaml.MappingNode, deep: bool = False):
    # PyYAML keeps the last of two equal keys silently; in a config that hides a mistake.
    seen: dict[str, yaml.Node] = {}
    for key_node, _ in node.value:
        key = normalize_key(str(loader.construct_object(key_node, deep=deep)))
        if key in seen:
            raise ConfigError(
                f"key {key!r} appears twice (lines {seen[key].start_mark.line + 1} and "
                f"{key_node.start_mark.line + 1}; dashes and underscores are the same); keep one"
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _json_object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if normalize_key(key) in {normalize_key(k) for k in out}:
            raise ConfigError(f"key {key!r} appears twice; keep one")
        out[key] = value
    return out


@dataclass
class Override:
    """A key set by an earlier file and changed by a later one."""

    key: str
    old: Any
    old_source: str
    new: Any
    new_source: str

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} ({self.old_source}) -> {self.new!r} ({self.new_source})"


@dataclass
class LoadedConfig:
    """The validated config, where each key came from, and what later files overrode."""

    config: NeoXConfig
    sources: dict[str, str] = field(default_factory=dict)
    overrides: list[Override] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def source_of(self, key: str) -> str:
        return self.sources.get(key, "default")

    def explain(self, error: ConfigError) -> ConfigError:
        """A check across keys made after loading (derive's layout and batch triple) prefixed
        with the files that set the keys its message names, as the loader's own are."""
        return ConfigError(f"{files_naming(str(error), self.sources)}: {error}")


def files_naming(message: str, sources: dict[str, str]) -> str:
    """The files that set the keys `message` names (`a.yml, b.yml`), or `defaults`."""
    files = {src for key, src in sources.items() if re.search(rf"\b{key}\b", message)}
    return ", ".join(sorted(files)) or "defaults"


def normalize_key(key: str) -> str:
    """gpt-neox treats `tensorboard-dir` and `tensorboard_dir` as one key."""
    return key.strip().replace("-", "_")


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse one YAML or JSON config file into a dict with normalised top-level keys."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; check the path (or -d/--conf_dir)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(
            f"{path}: not a text file (not UTF-8); pass a YAML or JSON config"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    if "\x00" in text:
        raise ConfigError(
            f"{path}: not a text file (it holds NUL bytes); pass a YAML or JSON config"
        )
    try:
        if path.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_json_object_without_duplicates)
        else:
            data = yaml.load(text, Loader=_Loader)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML/JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config; flatten it") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys, got {type(data).__name__}"
        )
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = normalize_key(str(raw_key))
        if key in out:
            raise ConfigError(
                f"{path}: key {key!r} appears twice (dashes and underscores are the same)"
            )
        out[key] = value
    return out


def resolve_paths(names: Iterable[str], conf_dir: Optional[str] = None) -> list[Path]:
    """Config names, prefixed by conf_dir when given (gpt-neox's -d/--conf_dir).

    As in gpt-neox, a name without .yml/.yaml/.json means the .yml file (`-d configs 125M`).
    """
    paths = []
    for name in names:
        path = Path(conf_dir) / name if conf_dir else Path(name)
        if path.suffix not in (".yml", ".yaml", ".json") and not path.is_file():
            path = path.with_name(path.name + ".yml")
        paths.append(path)
    return paths


def merge_files(paths: list[Path]) -> tuple[dict[str, Any], dict[str, str], list[Override]]:
    """Merge files in order: later keys replace earlier ones, and every replacement is recorded."""
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    overrides: list[Override] = []
    for path in paths:
        for key, value in read_config_file(path).items():
            if key in merged and merged[key] != value:
                overrides.append(Override(key, merged[key], sources[key], value, str(path)))
            merged[key] = value
            sources[key] = str(path)
    return merged, sources, overrides


def check_keys(flat: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    """Reject unknown and unimplemented keys by name; drop gpt-neox runtime keys."""
    known: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in flat.items():
        where = sources.get(key, "override")
        if key in KEY_OWNER:
            known[key] = value
        elif key in RUNTIME_KEYS:
            log.debug("ignoring gpt-neox runtime key %s from %s", key, where)
        elif (feature := unsupported_feature(key)) is not None:
            if is_inert(key, value):
                log.debug("ignoring %s=%r (%s is off) from %s", key, value, feature, where)
            else:
                problems.append(
                    f"{where}: {key}={value!r} asks for {feature}, which is not implemented in neox; "
                    f"remove the key"
                )
        else:
            close = difflib.get_close_matches(key, KEY_OWNER, n=3, cutoff=0.7)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            problems.append(f"{where}: unknown config key {key!r}{hint}")
    if problems:
        raise ConfigError("\n".join(problems))
    return known


def validate(flat: dict[str, Any], sources: dict[str, str]) -> NeoXConfig:
    """Build the typed config, turning pydantic's errors into messages that name the file."""
    try:
        return NeoXConfig.from_flat(flat)
    except ValidationError as e:
        raise ConfigError(_explain(e, flat, sources)) from None


# pydantic's bound errors, said as the fix: the bound and the range the key allows.
_BOUNDS = {
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "finite_number": "must be a finite number",
}


def _bound_message(err: dict[str, Any], key: str) -> str:
    """`must be >= 1 (allowed: [1, 4096])`: the bound broken, and the whole range when bounded."""
    msg = _BOUNDS[err["type"]].format(**err.get("ctx", {}))
    bounds: dict[str, Any] = {}
    for mark in FIELDS[key].metadata if key in FIELDS else ():
        for name in ("ge", "gt", "le", "lt"):
            if getattr(mark, name, None) is not None:
                bounds[name] = getattr(mark, name)
    low = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds.get("gt"))
    high = (bounds["le"], "]") if "le" in bounds else (bounds.get("lt"), ")")
    if low[1] is not None and high[0] is not None:
        msg += f" (allowed: {low[0]}{_number(low[1])}, {_number(high[0])}{high[1]})"
    return msg


def _number(x: Any) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 1e15 else str(x)


def _explain(error: ValidationError, flat: dict[str, Any], sources: dict[str, str]) -> str:
    lines = []
    for err in error.errors():
        loc = [str(p) for p in err["loc"]]
        key = loc[1] if len(loc) > 1 else (loc[0] if loc else "")
        msg = err["msg"].removeprefix("Value error, ")
        if key in flat:
            path = ".".join(loc[1:])
            where = sources.get(key, "override")
            if err["type"] in _BOUNDS:
                value = err["input"] if len(loc) > 2 else flat[key]
                lines.append(f"{where}: {path}={value!r} {_bound_message(err, key)}")
            else:
                lines.append(f"{where}: {path}={flat[key]!r}: {msg}")
        else:
            # A check across several keys (e.g. hidden_size vs heads): name the files involved,
            # those of the group's keys, or for a check across groups, of the keys it names.
            group = loc[0] if loc else ""
            involved = sorted(
                sources[k]
                for k in flat
                if k in sources
                and (KEY_OWNER.get(k) == group if group else re.search(rf"\b{k}\b", msg))
            )
            involved = sorted(set(involved))
            lines.append(f"{', '.join(involved) or 'defaults'}: {msg}")
    return "\n".join(lines)


def load_config(
    names: Iterable[str],
    conf_dir: Optional[str] = None,
    overrides: Optional[dict[str, Any]] = None,
) -> LoadedConfig:
    """Load, merge and validate config files (later files win), plus command-line overrides."""
    paths = resolve_paths(names, conf_dir)
    flat, sources, changed = merge_files(paths)
    for key, value in (overrides or {}).items():
        key = normalize_key(key)
        if key in flat and flat[key] != value:
            changed.append(Override(key, flat[key], sources[key], value, "command line"))
        flat[key] = value
        sources[key] = "command line"
    flat = check_keys(flat, sources)
    cfg = validate(flat, sources)
    return LoadedConfig(cfg, sources, changed, [str(p) for p in paths])


def load_dict(flat: dict[str, Any], source: str = "dict") -> NeoXConfig:
    """Validate an in-memory flat config (tests, the Python API, configs shipped in checkpoints)."""
    flat = {normalize_key(k): v for k, v in flat.items()}
    sources = {k: source for k in flat}
    return validate(check_keys(flat, sources), sources)
