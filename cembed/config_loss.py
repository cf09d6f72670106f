"""The ``loss`` config section: the base class every loss config extends, and the registry by name."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

from pydantic import PositiveFloat
from pydantic_core import PydanticUndefined

from cembed.strict import Strict as _Strict

DEFAULT_LOSS = "cached_mnrl"


class LossConfig(_Strict):
    """The ``loss`` section: the fields every loss has, plus ``name``, which picks the concrete class.

    Each loss is a subclass with ``name: Literal["<name>"] = "<name>"``, its own fields, and the
    ``uses_gradient_cache`` capability (True: the loss embeds in mini-batches of
    ``batch.mini_batch_size`` rows, GradCache style, so the probe can measure it). Subclasses are
    registered by name in :data:`LOSS_CONFIGS` (:func:`register_loss_config`, or
    ``cembed.losses.register_loss`` with its builder); :func:`loss_config` builds the registered
    class for a ``name``.
    """

    uses_gradient_cache: ClassVar[bool] = False

    name: str = DEFAULT_LOSS
    scale: PositiveFloat = 20.0
    symmetric: bool = False
    # Gather every rank's embeddings so each anchor is contrasted with the whole global batch.
    # None: true when training runs in more than one process.
    gather_across_devices: bool | None = None


class CachedMNRLLossConfig(LossConfig):
    """``cached_mnrl``: in-batch negatives InfoNCE with GradCache (memory set by ``mini_batch_size``)."""

    uses_gradient_cache: ClassVar[bool] = True

    name: Literal["cached_mnrl"] = "cached_mnrl"


class MNRLLossConfig(LossConfig):
    """``mnrl``: plain in-batch negatives InfoNCE, the whole batch embedded at once."""

    name: Literal["mnrl"] = "mnrl"


# name -> LossConfig subclass; `loss.name` in a config picks one.
LOSS_CONFIGS: dict[str, type[LossConfig]] = {}


def register_loss_config(cls: type[LossConfig]) -> type[LossConfig]:
    """Register a :class:`LossConfig` subclass under its ``name`` default (usable as a decorator).

    Raises:
        TypeError: ``cls`` is not a LossConfig subclass with a one-value ``Literal`` name.
        ValueError: the name is already registered to another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, LossConfig)) or cls is LossConfig:
        raise TypeError(f"{cls!r}: a loss config must be a subclass of cembed.config.LossConfig")
    field = cls.model_fields["name"]
    values = get_args(field.annotation)
    if len(values) != 1 or not isinstance(values[0], str) or field.default not in (values[0], PydanticUndefined):
        raise TypeError(f"{cls.__name__}.name: declare it as name: Literal['<name>'] = '<name>'")
    name = values[0]
    if LOSS_CONFIGS.get(name, cls) is not cls:
        raise ValueError(f"loss {name!r} is already registered ({LOSS_CONFIGS[name].__name__})")
    LOSS_CONFIGS[name] = cls
    return cls


def loss_config_class(name: Any) -> type[LossConfig]:
    """The registered :class:`LossConfig` subclass for ``name``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    cls = LOSS_CONFIGS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(LOSS_CONFIGS)}")
    return cls


def loss_config(**fields: Any) -> LossConfig:
    """The registered loss config for ``fields["name"]`` (default ``cached_mnrl``), validated.

    Raises:
        ValueError: unknown name (listing the known ones); pydantic's ValidationError for bad fields.
    """
    return loss_config_class(fields.get("name", DEFAULT_LOSS)).model_validate(fields)


register_loss_config(CachedMNRLLossConfig)
register_loss_config(MNRLLossConfig)
