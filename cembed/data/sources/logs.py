"""Library log lines captured while a source loads, so that an error quotes their cause, and that
cause (and the shard the libraries name) in one line."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from cembed.errors import first_line

# What datasets says when it wraps a reader's error: the reader's own words are its cause.
_WRAPPERS = ("An error occurred while generating the dataset",)
# How datasets' readers name the file they failed on when they log it before raising.
_FILE_IN_LOG = re.compile(r"(?:file|from) '([^']+)'")


@contextmanager
def captured_library_logs(
    names: tuple[str, ...] = ("datasets", "pyarrow", "fsspec"),
) -> Iterator[list[logging.LogRecord]]:
    """Hold the records of the data libraries' loggers (``names``) back from the terminal while the
    block runs; they are yielded as a list for the caller to inspect.

    ``datasets`` logs a parser failure at ERROR level (``Failed to load JSON from file ... ArrowInvalid``)
    before it raises; the loader turns the exception into one clean line, so that record would be a
    second, raw message about the same problem.
    """
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    saved = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers = [_Keep()]
        logger.propagate = False  # the root logger's handlers (a user's basicConfig) would print it too
    try:
        yield records
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate


def library_cause(err: BaseException) -> str:
    """A data library's error (``datasets``, ``pyarrow``) in one line that keeps its cause: the first
    error along the chain of causes that is not ``datasets``' generic wrapper ("An error occurred
    while generating the dataset"); ``datasets``' ``CastError`` as the columns it found and wanted."""
    chain, seen = [err], {id(err)}
    while True:
        last = chain[-1]
        following = last.__cause__ or (last.__context__ if not last.__suppress_context__ else None)
        if following is None or id(following) in seen:
            break
        chain.append(following)
        seen.add(id(following))
    for e in chain:
        found, wanted = getattr(e, "table_column_names", None), getattr(e, "requested_column_names", None)
        if found is not None and wanted is not None:  # datasets.table.CastError
            return f"columns {', '.join(found)} do not match {', '.join(wanted)} ({e.details()})"
    informative = [e for e in chain if first_line(e) not in _WRAPPERS]
    return first_line(informative[0] if informative else chain[-1])


def file_named_in(records: Iterable[logging.LogRecord], files: Iterable[str] | None = None) -> str | None:
    """The file a data library's log records name as the one it failed on (one of ``files`` when
    given), or None."""
    wanted = [str(f) for f in files] if files is not None else None
    for record in records:
        message = record.getMessage()
        if wanted is not None:
            hit = next((f for f in wanted if f in message), None)
            if hit is not None:
                return hit
            continue
        match = _FILE_IN_LOG.search(message)
        if match:
            return match.group(1)
    return None
