"""The base of every config group, and how a field declares its status.

A key is one declaration: its type (with its bounds), default, docstring and status, written
where the field is defined. The status is one of:

- read: `Annotated[int, Reads("neox/model/gpt.py")]` names the modules that implement it;
- no-op: a gpt-neox key with no meaning in neox; its docstring starts with "No-op" and says why;
- refused: `Annotated[bool, Refused(feature, example, message)]` fails validation for any value
  but the feature-off ones, naming the feature.

A key that works only with some values of other keys says so once, in a `Restricted(says, ...)`
mark: the statement ends the field's description (and so its row in docs/config.md),
and the group's checks enforce it (a model validator for rules among its own keys; a `check_with`
for rules that read other groups, run by NeoXConfig; a `check_run` for rules that need the run's
layout or batch, run by `derive`).

tests/config/test_registry.py checks each declaration against the code; docs/config.md shows it.
"""

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler, ValidationInfo
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

# Upper bounds of sizes and counts: far above any run that fits in memory, low enough that a
# typo (an extra few zeros) is refused here rather than failing an allocation on every rank.
MAX_LAYERS = 1 << 12
MAX_WIDTH = 1 << 20  # hidden size and heads: one hidden x hidden weight is then 2**40 elements
MAX_MLP_WIDTH = 1 << 22
MAX_POSITIONS = 1 << 24  # tokens in a sequence: 16M, beyond every released context length
MAX_VOCAB = 1 << 24
MAX_BATCH = 1 << 24  # sequences in a batch
MAX_COUNT = 1 << 40  # iterations, intervals, bucket sizes: past int64 arithmetic trouble
MAX_RANKS = 1 << 20
# A learning rate this high overflows the weights at the first update; below it a run that
# diverges still runs, into the non-finite-step guard (tests/faults/test_checkpoint_faults.py).
MAX_LR = 1e30


class ConfigGroup(BaseModel):
    """One concern's settings; unknown keys are errors and field docstrings are the docs."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        frozen=False,
        allow_inf_nan=False,  # NaN or inf in a float key is always a mistake
    )

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for field in cls.model_fields.values():
            for mark in field.metadata:
                if isinstance(mark, Restricted) and mark.says not in (field.description or ""):
                    field.description = f"{field.description or ''} Restricted: {mark.says}"

    def model_copy(self, *, update: Optional[dict[str, Any]] = None, deep: bool = False) -> Any:
        """A copy; with `update`, validated like a new config (pydantic's own copy would skip
        the checks and leave derived values such as ModelConfig.shape stale)."""
        if not update:
            return super().model_copy(deep=deep)
        explicit = {k: getattr(self, k) for k in self.model_fields_set if k not in update}
        return type(self)(**explicit, **update)


@dataclass(frozen=True, init=False)
class Reads:
    """Implemented: read by these modules (paths from the repository root)."""

    modules: tuple[str, ...]

    def __init__(self, *modules: str) -> None:
        object.__setattr__(self, "modules", modules)


@dataclass(frozen=True)
class Refused:
    """A gpt-neox feature neox does not implement: a value outside `allowed` (the feature-off
    values) fails validation with `message` (formatted with {key} and {value}), which names
    `feature`; `example` is a value that asks for it."""

    feature: str
    example: Any
    message: str
    allowed: tuple[Any, ...] = (False,)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.with_info_after_validator_function(self._check, handler(source))

    def _check(self, value: Any, info: ValidationInfo) -> Any:
        if value not in self.allowed:
            raise ValueError(self.message.format(key=info.field_name, value=value))
        return value


@dataclass(frozen=True)
class Restricted:
    """The rule that ties a key to other keys, stated once: `says` is appended to the field's
    description; the owning group's checks enforce it. `example` (flat keys) uses the key
    validly; each of `broken_by` is valid alone but breaks the rule added to `example`, which
    tests/config/test_registry.py checks."""

    says: str
    example: dict[str, Any]
    broken_by: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class NoOp:
    """A gpt-neox key with no meaning in neox: accepted, documented as a no-op, read nowhere."""


Status = Union[Reads, NoOp, Refused]


def status_of(field: FieldInfo) -> Optional[Status]:
    """The status a field declares (None: it declares none, which the registry test refuses)."""
    for mark in field.metadata:
        if isinstance(mark, Refused):
            return mark
    if (field.description or "").startswith("No-op"):
        return NoOp()
    for mark in field.metadata:
        if isinstance(mark, Reads):
            return mark
    return None


def check_finite(value: Any, path: str) -> None:
    """Raise ValueError naming `path` (e.g. `fp16.loss_scale`) at the first NaN or infinity in a
    section passed through as written, so DeepSpeed never receives one."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path}={value} must be a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            check_finite(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_finite(v, f"{path}[{i}]")
