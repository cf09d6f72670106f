"""The base class of every config section, and the registration rule of the kinds a YAML file names
(source kinds, losses)."""

from functools import partial
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticUndefined

from cembed.plugins import plugin_of


class Strict(BaseModel):
    """A config section: unknown keys are refused and assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def register_by_literal(registry: dict, cls: Any, base: type, field: str, what: str) -> type:
    """Add ``cls`` to ``registry`` under the one value of its ``field: Literal["<key>"]`` (the key a YAML
    file names it by: a source's ``kind``, a loss's ``name``); registering the same class twice is a no-op.

    Raises:
        TypeError: ``cls`` is not a subclass of ``base``, or ``field`` is not a one-value ``Literal`` whose
            default (if any) is that value.
        ValueError: the key is already registered to another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, base)) or cls is base:
        raise TypeError(f"{cls!r}: a {what} config must be a subclass of {base.__module__}.{base.__name__}")
    info = cls.model_fields[field]
    values = get_args(info.annotation)
    if len(values) != 1 or not isinstance(values[0], str) or info.default not in (values[0], PydanticUndefined):
        raise TypeError(f"{cls.__name__}.{field}: declare it as {field}: Literal['<{field}>'] = '<{field}>'")
    key = values[0]
    if registry.get(key, cls) is not cls:
        raise ValueError(f"{what} {key!r} is already registered ({registered_by(registry[key])})")
    registry[key] = cls
    return cls


def registered_by(obj: Any) -> str:
    """How a refusal names what holds a registry's name: the class or function, and the plugin that
    brought it in (:func:`cembed.plugins.plugin_of`), so two plugins' clash names both."""
    obj = obj.func if isinstance(obj, partial) else obj
    owner = plugin_of(obj)
    name = getattr(obj, "__name__", None) or type(obj).__name__
    return f"{name}, from {owner}" if owner else name


def registered(registry: dict, key: Any, what: str) -> type:
    """The class ``registry`` holds for ``key`` (see :func:`register_by_literal`).

    Raises:
        ValueError: an unknown key (or not a string); the message lists the known ones.
    """
    cls = registry.get(key) if isinstance(key, str) else None
    if cls is None:
        raise ValueError(f"unknown {what} {key!r}; known: {', '.join(registry)}")
    return cls
