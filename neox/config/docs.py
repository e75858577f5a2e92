"""Generate docs/config.md from the schema: `python -m neox.config.docs > docs/config.md`."""

import json
import typing

from neox.config.base import NoOp, Reads, Refused, status_of
from neox.config.schema import GROUPS

HEADER = """# Configuration reference

Generated from the schema in `neox/config/` by `python -m neox.config.docs > docs/config.md`;
a test fails when this file is stale. Keys are flat, as in gpt-neox: write `hidden_size: 512`
(or `hidden-size`) at the top level of any config file. Files given to `deepy.py` merge in order,
later files overriding earlier ones.

Values computed from these keys (the model's head size, key/value heads, MLP width and layer
types; the data-parallel size, batch triple, schedule iterations, padded vocabulary, precision
and optimizer type) are never keys: `neox/config/shape.py` (the model's) and
`neox/config/derived.py` (the run's) compute each once, and `deepy.py --dry-run` prints them
under `# derived`. A key that works only with some values of other keys says so after
"Restricted:" in its description.
"""


def _type_name(annotation) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        # An element type with its own bounds, e.g. the blending weights' list[float (>= 0)].
        marks = [m for a in args[1:] for m in getattr(a, "metadata", [a])]
        return _type_name(args[0]) + _bounds_of(marks)
    if typing.get_origin(annotation) is list:
        return f"list[{_type_name(args[0])}]"
    if typing.get_origin(annotation) is typing.Union and type(None) in args and len(args) == 2:
        return f"Optional[{_type_name(next(a for a in args if a is not type(None)))}]"
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(repr(a) for a in args)  # a pipe escaped for the markdown table
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    return text.replace("typing.", "").replace("NoneType", "None").replace("|", "\\|")


def _bounds_of(marks: list) -> str:
    """` (>= 1, <= 4096)`: the range a numeric key allows."""
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [
        f"{sign} {getattr(mark, name)}"
        for mark in marks
        for name, sign in signs.items()
        if getattr(mark, name, None) is not None
    ]
    return f" ({', '.join(parts)})" if parts else ""


def _status(field) -> str:
    status = status_of(field)
    if isinstance(status, Reads):
        return "read by " + ", ".join(m.removeprefix("neox/") for m in status.modules)
    if isinstance(status, NoOp):
        return "no-op"
    if isinstance(status, Refused):
        return f"refused unless {' or '.join(json.dumps(a) for a in status.allowed)}"
    return "undeclared"


def _default(field) -> str:
    value = field.default
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    return "`" + json.dumps(value) + "`"


def render() -> str:
    """The whole markdown reference."""
    out = [HEADER]
    for name, cls in GROUPS.items():
        out.append(f"\n## {name}: {cls.__name__}\n\n{(cls.__doc__ or '').strip()}\n")
        out.append("| key | type | default | status | description |")
        out.append("| --- | --- | --- | --- | --- |")
        for key, field in cls.model_fields.items():
            doc = " ".join((field.description or "").split()).replace("|", "\\|")
            kind = _type_name(field.annotation) + _bounds_of(field.metadata)
            out.append(f"| `{key}` | {kind} | {_default(field)} | {_status(field)} | {doc} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
