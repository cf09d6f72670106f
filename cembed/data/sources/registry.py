"""Training-data sources: one loader per source kind, each returning a ``datasets.Dataset``.

A source kind is a config class in :mod:`cembed.config.sources` (a :class:`~cembed.config.sources.SourceConfig`
subclass registered with :func:`~cembed.config.sources.register_source_config`: :class:`~cembed.config.sources.FileSource`,
:class:`~cembed.config.sources.HubSource`, :class:`~cembed.config.sources.BeirSource`,
:class:`~cembed.config.sources.PreparedSource`, :class:`~cembed.config.sources.SavedSource`) plus a loader here registered with :func:`register_source_loader`
(in :data:`LOADERS`); :func:`load_source`, :func:`row_locator`, :func:`count_files` and :func:`open_stream`
dispatch on the source's ``kind``, so no stage asks which kind a source is. A file is scanned with the
standard library (:func:`cembed.data.sources.diagnose.diagnose_file`) so a malformed one is refused with
its line, not a parser traceback. A kind may come from a plugin (:mod:`cembed.plugins`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cembed.config.base import registered_by
from cembed.config.sources import (
    SourceConfig,
)
from cembed.data.sources.beir import load_beir_pairs
from cembed.data.sources.file_kind import load_file, shard_count
from cembed.data.sources.file_kind import skipped_files as file_skips
from cembed.data.sources.file_stream import open_file_stream
from cembed.data.sources.hub import load_hub
from cembed.data.sources.locate import file_row_locator, row_number
from cembed.data.sources.logs import captured_library_logs, file_named_in, library_cause
from cembed.data.sources.prepared import load_prepared
from cembed.data.sources.saved import load_saved
from cembed.errors import UserError
from cembed.files import display_path


@dataclass(frozen=True)
class SourceLoader:
    """How one source kind's data is read: ``load`` and the optional hooks of what else the kind can do.

    Attributes:
        load: ``(source config) -> datasets.Dataset``; raises :class:`~cembed.errors.UserError` for
            bad data (naming the source, and the file and line where it can). A kind whose config
            :attr:`~cembed.config.sources.SourceConfig.is_pretokenized` returns token ids with the
            manifest as the dataset's ``cembed_manifest``.
        row_locator: ``(source config) -> (0-based row index -> "line N" / "row N")`` for messages
            about one row; ``None``: ``row N`` (1-based).
        count_files: ``(source config) -> int | None``: how many files the source reads when it
            names several (shards: ``validate``'s "(N files)", the run summary's ``files``); None
            for one file. ``None`` (no hook): the kind reads no shards.
        skipped_files: ``(source config) -> tuple[str, ...]``: what the source's folder or glob holds
            but does not read, each ``"<path> (<why>)"`` (``validate`` lists them); ``None`` (no
            hook): nothing is skipped.
        open_stream: ``(source config) -> datasets.IterableDataset``, its rows in a fixed order, for a
            kind whose config can ask to be streamed (:meth:`~cembed.config.sources.SourceConfig.stream_options`).
    """

    load: Callable[[Any], Any]
    row_locator: Callable[[Any], Callable[[int], str]] | None = None
    count_files: Callable[[Any], int | None] | None = None
    open_stream: Callable[[Any], Any] | None = None
    skipped_files: Callable[[Any], tuple[str, ...]] | None = None


# kind -> its loader. A new kind of source is one class in cembed.config.sources and one entry here.
LOADERS: dict[str, SourceLoader] = {}


def register_source_loader(
    kind: str,
    load: Callable[[Any], Any],
    row_locator: Callable[[Any], Callable[[int], str]] | None = None,
    *,
    count_files: Callable[[Any], int | None] | None = None,
    open_stream: Callable[[Any], Any] | None = None,
    skipped_files: Callable[[Any], tuple[str, ...]] | None = None,
) -> None:
    """Register the loader (and optionally its hooks, see :class:`SourceLoader`) of the source
    kind ``kind`` (the ``kind`` of a class registered with :func:`cembed.config.sources.register_source_config`).
    Registering the same loader and hooks again is a no-op.

    Raises:
        ValueError: ``kind`` already has another loader.
    """
    entry = SourceLoader(load, row_locator, count_files, open_stream, skipped_files)
    if LOADERS.get(kind, entry) != entry:
        raise ValueError(f"source kind {kind!r} already has a loader ({registered_by(LOADERS[kind].load)})")
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


def count_files(source: SourceConfig) -> int | None:
    """How many files ``source`` reads when it names several (its kind's ``count_files`` hook: a
    sharded file source's files); None for one file or a kind that reads no shards.

    Raises:
        UserError: see the kind's hook (:func:`cembed.data.sources.file_kind.source_files`).
    """
    count = _loader(source).count_files
    return count(source) if count is not None else None


def skipped_files(source: SourceConfig) -> tuple[str, ...]:
    """What ``source``'s folder or glob holds but does not read, each ``"<path> (<why>)"`` (its kind's
    ``skipped_files`` hook: a sharded file source's hidden and underscore-prefixed paths, files that
    are not data, 0-row shards); ``()`` for a kind without the hook.

    Raises:
        UserError: see the kind's hook (:func:`cembed.data.sources.file_kind.resolve_shards`).
    """
    skipped = _loader(source).skipped_files
    return tuple(skipped(source)) if skipped is not None else ()


def open_stream(source: SourceConfig):
    """``source``'s rows as a ``datasets.IterableDataset`` read lazily in a fixed order, through its
    kind's ``open_stream`` hook (a file source: :func:`cembed.data.sources.file_stream.open_file_stream`).

    Raises:
        UserError: see the kind's hook.
        TypeError: a kind without the hook (its config must not ask to be streamed).
    """
    opener = _loader(source).open_stream
    if opener is None:
        raise TypeError(f"source kind {source.kind!r} has no open_stream hook; it cannot be read as a stream")
    return opener(source)


def read_head(source: SourceConfig, rows: int):
    """The first ``rows`` rows of a source read as a stream (:func:`open_stream`: no shuffle, no
    split), as an in-memory ``datasets.Dataset``: what ``validate`` and ``train`` check of a streamed
    source (columns, cells) without reading the rest.

    Raises:
        UserError: see :func:`open_stream`; a library error while reading, in one line with its
            cause and the file the library names (:func:`cembed.data.sources.logs.library_cause`).
    """
    import datasets

    stream = open_stream(source)
    try:
        with captured_library_logs() as records:
            head = list(stream.take(rows))
    except UserError:
        raise
    except Exception as err:  # datasets and pyarrow raise many types
        raise UserError(stream_read_error(source.label, err, records)) from None
    return datasets.Dataset.from_list(head)


def stream_read_error(label: str, err: BaseException, records) -> str:
    """The one-line message for a library error while reading ``label``'s stream: the source, the
    file the library's log names (when it does) and the library's cause."""
    named = file_named_in(records)
    where = f"{display_path(label)}: " + (f"{display_path(named)}: " if named else "")
    return f"{where}cannot read as a stream: {library_cause(err)}"


register_source_loader(
    "file",
    load_file,
    file_row_locator,
    count_files=shard_count,
    open_stream=open_file_stream,
    skipped_files=file_skips,
)
register_source_loader("hub", load_hub)
register_source_loader("beir", load_beir_pairs)
register_source_loader("prepared", load_prepared)
register_source_loader("saved", load_saved)
