"""The base class of every config section."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A config section: unknown keys are refused and assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
