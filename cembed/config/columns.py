"""Which column of a source plays which role: anchor, positive, negatives."""

from __future__ import annotations

from pydantic import (
    Field,
    model_validator,
)

from cembed.config.base import Strict as _Strict


class ColumnMap(_Strict):
    """Source column names for the roles the loss expects; every other column is dropped."""

    anchor: str = Field("anchor", description="column holding the anchor (query) text")
    positive: str = Field("positive", description="column holding the positive text for the anchor")
    negatives: list[str] = Field(
        default_factory=list, description="columns holding hard negatives, one role (negative_1..k) each"
    )
    # None, not []: a checkpoint recorded before this field compares equal on resume.
    ignore: list[str] | None = Field(
        None, description="columns known not to be text for training (ids, labels): dropped without a warning"
    )

    @model_validator(mode="after")
    def _ignored_not_mapped(self) -> ColumnMap:
        roles = {self.anchor: "anchor", self.positive: "positive"} | {n: "a negative" for n in self.negatives}
        mapped = next((n for n in self.ignore or () if n in roles), None)
        if mapped is not None:
            raise ValueError(f"ignore: column {mapped!r} is mapped as {roles[mapped]}; remove it from ignore")
        return self
