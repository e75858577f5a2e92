"""Every schema key is read by the code that implements it, a documented no-op, or refused."""

import re
from pathlib import Path

import pytest

from neox.config import ConfigError, derive, load_dict
from neox.config.base import Restricted
from neox.config.registry import KEYS, NoOp, Reads, Refused
from neox.config.schema import GROUPS, KEY_OWNER

ROOT = Path(__file__).resolve().parents[2]
# Modules that declare keys (validators there are not an implementation, except derived values).
SCHEMA_FILES = {
    "neox/config/base.py",
    "neox/config/schema.py",
    "neox/config/registry.py",
    "neox/config/docs.py",
    "neox/config/loader.py",
    "neox/config/transport.py",
}


def read_pattern(key: str, strings: bool = True) -> re.Pattern:
    # An attribute read (`cfg.training.do_train`, not a method call `.split(`), or the key as a
    # string in a table of keys (ds_config's shorthands).
    attribute = rf"\.{key}\b(?!\s*\()"
    return re.compile(attribute + rf"|[\"']{key}[\"']" if strings else attribute)


def field_of(key: str):
    return GROUPS[KEY_OWNER[key]].model_fields[key]


def code_files() -> dict[str, str]:
    files = [*ROOT.glob("neox/**/*.py"), *ROOT.glob("*.py"), *ROOT.glob("tools/*.py")]
    out = {}
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        group_module = rel.startswith("neox/config/") and rel not in (
            "neox/config/derived.py",
            "neox/config/ds_config.py",
            "neox/plan/preflight.py",
        )
        if not group_module or rel == "neox/config/model.py":
            out[rel] = path.read_text()
    return out


def test_every_key_declares_its_status():
    assert set(KEYS) == set(KEY_OWNER)
    undeclared = sorted(k for k, status in KEYS.items() if status is None)
    assert not undeclared, (
        f"keys that declare no status: {undeclared}; mark the field Reads(...) or Refused(...), "
        "or start its docstring with 'No-op' (neox/config/base.py)"
    )


def test_a_field_without_a_declaration_is_noticed():
    from pydantic import Field

    from neox.config.base import ConfigGroup, status_of

    class Probe(ConfigGroup):
        plain: int = Field(1, ge=0)
        """Read somewhere, but nobody said where."""

    assert status_of(Probe.model_fields["plain"]) is None


@pytest.mark.parametrize(
    "key,status", [pytest.param(k, s, id=k) for k, s in KEYS.items() if isinstance(s, Reads)]
)
def test_implemented_key_is_read_where_registered(key, status):
    pattern = read_pattern(key)
    for module in status.modules:
        path = ROOT / module
        assert path.is_file(), f"{key}: registered reader {module} does not exist"
        assert pattern.search(path.read_text()), f"{key} is not read in {module}"
    doc = field_of(key).description or ""
    assert doc and "no-op" not in doc.lower(), f"{key}: document what it does"
    assert "no effect" not in doc.lower() and "accepted" not in doc.lower(), key


@pytest.mark.parametrize("key", [k for k, s in KEYS.items() if isinstance(s, NoOp)])
def test_noop_key_is_documented_and_read_nowhere(key):
    doc = field_of(key).description or ""
    assert doc.startswith("No-op"), f"{key}: a no-op's docstring starts with 'No-op' and says why"
    pattern = read_pattern(key, strings=False)
    readers = [m for m, text in code_files().items() if pattern.search(text)]
    assert not readers, f"{key} is registered as a no-op but {readers} read it"


@pytest.mark.parametrize("key", [k for k, s in KEYS.items() if isinstance(s, Refused)])
def test_refused_key_names_its_feature(key):
    status = KEYS[key]
    load_dict({key: field_of(key).default})  # the default asks for nothing
    with pytest.raises(ConfigError) as e:
        load_dict({key: status.example})
    assert key in str(e.value) and status.feature.lower() in str(e.value).lower()


def restrictions() -> list:
    return [
        pytest.param(key, mark, flat, id=f"{key}-{i}")
        for cls in GROUPS.values()
        for key, field in cls.model_fields.items()
        for mark in field.metadata
        if isinstance(mark, Restricted)
        for i, flat in enumerate(mark.broken_by)
    ]


def _load_and_derive(flat: dict) -> None:
    world = flat.get("model_parallel_size", 1) * max(1, flat.get("pipe_parallel_size", 1))
    derive(load_dict(flat), world)


@pytest.mark.parametrize("key,mark,flat", restrictions())
def test_restricted_key_states_its_rule_and_is_checked(key, mark, flat):
    """The statement is in the key's doc; the example loads, and so do the keys that break the
    rule alone, but together they are refused naming the key."""
    assert mark.says in field_of(key).description
    _load_and_derive(mark.example)
    _load_and_derive(flat)
    with pytest.raises(ConfigError, match=key):
        _load_and_derive({**mark.example, **flat})


def test_some_keys_state_their_restrictions():
    assert {key for key, _, _ in (p.values for p in restrictions())} >= {"lora_rank", "train_impl"}
