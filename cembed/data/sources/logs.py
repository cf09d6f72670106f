"""Library log lines captured while a source loads, so that an error quotes their cause."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


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
