"""The base of every config group: strict, documented at the field; and the checks many share."""

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class ConfigGroup(BaseModel):
    """One concern's settings; unknown keys are errors and field docstrings are the docs."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, frozen=False
    )

    def model_copy(self, *, update: Optional[dict[str, Any]] = None, deep: bool = False) -> Any:
        """A copy; with `update`, validated like a new config (pydantic's own copy would skip
        the checks and leave derived values such as ModelConfig.shape stale)."""
        if not update:
            return super().model_copy(deep=deep)
        explicit = {k: getattr(self, k) for k in self.model_fields_set if k not in update}
        return type(self)(**explicit, **update)


def refuse_unless(*fields: str, allowed: tuple[Any, ...], message: str) -> Any:
    """Field validator for gpt-neox keys whose feature neox lacks: a value outside `allowed`
    (the feature-off values) raises `message`, formatted with {key} and {value}."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if value not in allowed:
            raise ValueError(message.format(key=info.field_name, value=value))
        return value

    return field_validator(*fields)(check)


def at_least(*fields: str, least: float, hint: str = "") -> Any:
    """Field validator: `key=value must be >= least` (an unset None passes)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if value is not None and value < least:
            raise ValueError(f"{info.field_name}={value} must be >= {least}{hint}")
        return value

    return field_validator(*fields)(check)
