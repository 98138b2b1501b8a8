"""The config's field types (counts and sizes written as `4K`, `2GiB`) and the base of every section."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from batchpilot.errors import BatchpilotError
from batchpilot.planning.units import parse_bytes, parse_count


def _count(value: Any) -> int:
    try:
        return parse_count(value, field="value")
    except BatchpilotError as error:
        raise ValueError(f"{error.problem}; {error.fix}" if error.fix else error.problem) from None


def _bytes(value: Any) -> int:
    try:
        return parse_bytes(value, field="value")
    except BatchpilotError as error:
        raise ValueError(f"{error.problem}; {error.fix}" if error.fix else error.problem) from None


Count = Annotated[int, BeforeValidator(_count), Field(ge=0)]
"""A sample/token count: an integer or a string with a K/M/B/T suffix (`10M`)."""


PositiveCount = Annotated[int, BeforeValidator(_count), Field(gt=0)]


ByteSize = Annotated[int, BeforeValidator(_bytes), Field(gt=0)]
"""A size in bytes: an integer or a string such as `2GiB`."""


PositiveInt = Annotated[int, Field(gt=0)]


class _Section(BaseModel):
    """Base of every section: frozen, and unknown keys are reported with the valid ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    omitted_when_unset: ClassVar[tuple[str, ...]] = ()
    """Settings added after the compiled pipelines' format settled: left out of a dump while unset (None), so
    that a pipeline compiled from a config without them stays byte-identical (a config read back gets the
    default)."""

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        data: dict[str, object] = handler(self)
        for name in self.omitted_when_unset:
            if data.get(name) is None:
                data.pop(name, None)
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"unknown key {unknown[0]!r}; valid keys are: {', '.join(cls.model_fields)}")
        return data
