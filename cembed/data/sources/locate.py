"""How messages name one row of a source: ``line N`` of a file (its shard), else ``row N``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from cembed.config.sources import (
    FileSource,
)
from cembed.data.sources.file_kind import is_sharded, source_files
from cembed.data.sources.text import csv_records, delimiter_of, inner_name, text_lines
from cembed.errors import UserError
from cembed.files import display_path


def row_number(index: int) -> str:
    """How messages name a row by its 0-based index when its source has no better locator: ``row N`` (1-based)."""
    return f"row {index + 1}"


def file_row_locator(source: FileSource) -> Callable[[int], str]:
    """How messages name a row of a data file by its 0-based index: ``line N`` for a JSON Lines file
    (blank lines skipped, as the reader does) and for a CSV/TSV file (the line the row starts on,
    after the header; blank lines skipped), ``row N`` (1-based) otherwise. A sharded source's row
    is ``<shard>: line N`` (or ``<shard>: row N``), found by counting each shard's rows, only when
    a message asks."""
    if not is_sharded(source):
        return _one_file_locator(Path(source.path))

    def locate_shard(index: int) -> str:
        try:
            files = source_files(source)
        except UserError:
            return row_number(index)
        start = 0
        for path in files:
            rows = _count_rows(path)
            if rows is None:
                break
            if index < start + rows:
                return f"{display_path(path)}: {_one_file_locator(path)(index - start)}"
            start += rows
        return row_number(index)

    return locate_shard


def _count_rows(path: Path) -> int | None:
    """The rows a data file holds, as the loader reads them (None: unknown, or unreadable)."""
    name = inner_name(path)
    try:
        if name.endswith(".jsonl"):
            return sum(1 for _, text in text_lines(path) if text.strip())
        delimited = delimiter_of(path)
        if delimited is not None:
            return max(sum(1 for _ in csv_records(path, *delimited)) - 1, 0)
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
        if name.endswith(".json"):
            text = "".join(t for _, t in text_lines(path))
            try:
                data = json.loads(text)
            except json.JSONDecodeError:  # JSON Lines in a .json file: datasets' json builder reads it so
                return sum(1 for line in text.splitlines() if line.strip())
            return len(data) if isinstance(data, list) else None
    except Exception:  # noqa: BLE001 - a locator falls back to the row's global number
        return None
    return None


def _one_file_locator(path: Path) -> Callable[[int], str]:
    """:func:`file_row_locator` of one file."""
    delimited = delimiter_of(path)
    if delimited is not None:

        def locate_record(index: int) -> str:
            try:
                for number, (first, _, _) in enumerate(csv_records(path, *delimited), start=-1):
                    if number == index:
                        return f"line {first}"
            except ValueError:
                pass
            return row_number(index)

        return locate_record
    if not inner_name(path).endswith(".jsonl"):
        return row_number

    def locate(index: int) -> str:
        rows = -1
        try:
            for number, text in text_lines(path):
                rows += bool(text.strip())
                if rows == index:
                    return f"line {number}"
        except ValueError:
            pass
        return row_number(index)

    return locate
