"""Training-data sources: one loader per source kind, each returning a ``datasets.Dataset``.

A source kind is a config class in :mod:`cembed.config.sources` (a :class:`~cembed.config.sources.SourceConfig`
subclass registered with :func:`~cembed.config.sources.register_source_config`: :class:`~cembed.config.sources.FileSource`,
:class:`~cembed.config.sources.HubSource`, :class:`~cembed.config.sources.BeirSource`) plus a loader here registered
with :func:`register_source_loader` (in :data:`LOADERS`); :func:`load_source` dispatches on the source's
``kind``. A file is scanned with the standard library (:func:`cembed.data.sources.diagnose.diagnose_file`) so a malformed one is
refused with its line, not a parser traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cembed.config.sources import (
    SourceConfig,
)
from cembed.data.sources.beir import load_beir_pairs
from cembed.data.sources.files import load_file
from cembed.data.sources.hub import load_hub
from cembed.data.sources.locate import file_row_locator, row_number
from cembed.data.sources.prepared import load_prepared


@dataclass(frozen=True)
class SourceLoader:
    """How one source kind's data is read.

    Attributes:
        load: ``(source config) -> datasets.Dataset``; raises :class:`~cembed.errors.UserError` for
            bad data (naming the source, and the file and line where it can).
        row_locator: ``(source config) -> (0-based row index -> "line N" / "row N")`` for messages
            about one row; ``None``: ``row N`` (1-based).
    """

    load: Callable[[Any], Any]
    row_locator: Callable[[Any], Callable[[int], str]] | None = None


# kind -> its loader. A new kind of source is one class in cembed.config.data and one entry here.
LOADERS: dict[str, SourceLoader] = {}


def register_source_loader(
    kind: str, load: Callable[[Any], Any], row_locator: Callable[[Any], Callable[[int], str]] | None = None
) -> None:
    """Register the loader (and optionally the row locator, see :class:`SourceLoader`) of the source
    kind ``kind`` (the ``kind`` of a class registered with :func:`cembed.config.sources.register_source_config`).

    Raises:
        ValueError: ``kind`` already has another loader.
    """
    entry = SourceLoader(load, row_locator)
    if LOADERS.get(kind, entry) != entry:
        raise ValueError(f"source kind {kind!r} already has a loader ({LOADERS[kind].load.__name__})")
    LOADERS[kind] = entry


def _loader(source: SourceConfig) -> SourceLoader:
    entry = LOADERS.get(source.kind)
    if entry is None:
        raise TypeError(
            f"no loader registered for {type(source).__name__} (kind {source.kind!r}) in cembed.data.sources.registry.LOADERS"
        )
    return entry


def row_locator(source: SourceConfig) -> Callable[[int], str]:
    """How messages name a row of ``source``'s data by its 0-based index: its kind's row locator
    (``line N`` for a JSON Lines file), else ``row N`` (1-based).

    Raises:
        TypeError: a source kind with no registered loader (a programming error, not a user one).
    """
    locator = _loader(source).row_locator
    return locator(source) if locator is not None else row_number


def load_source(source: SourceConfig):
    """Load any training-data source as a ``datasets.Dataset``, through its kind's entry in :data:`LOADERS`.

    Raises:
        UserError: see :func:`load_file`, :func:`load_hub` and :func:`load_beir_pairs` (or the kind's loader).
        TypeError: a source kind with no registered loader (a programming error, not a user one).
    """
    return _loader(source).load(source)


register_source_loader("file", load_file, file_row_locator)
register_source_loader("hub", load_hub)
register_source_loader("beir", load_beir_pairs)
register_source_loader("prepared", load_prepared)
