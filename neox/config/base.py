"""The base of every config group: strict, documented at the field."""

from pydantic import BaseModel, ConfigDict


class ConfigGroup(BaseModel):
    """One concern's settings; unknown keys are errors and field docstrings are the docs."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, frozen=False
    )
