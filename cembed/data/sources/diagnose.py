"""Why a data file cannot be read: the file and line of the first problem, found with the standard library."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from cembed.data.sources.text import csv_records, delimiter_of, inner_name, text_lines
from cembed.files import display_path


def diagnosis(files: list[Path]) -> str | None:
    """The first problem :func:`diagnose_file` finds in ``files``, prefixed by the shard when there are several."""
    for path in files:
        problem = diagnose_file(path)
        if problem:
            return f"{display_path(path)}: {problem}" if len(files) > 1 else problem
    return None


def diagnose_file(path: Path) -> str | None:
    """Scan a local data file with the standard library and describe its first problem, or return
    ``None`` when it parses: corrupt/truncated gzip, non-UTF-8 bytes, invalid JSON on line N, a JSON
    line that is not an object, a CSV/TSV row whose field count differs from the header's, no rows."""
    name = inner_name(path)
    try:
        if name.endswith(".jsonl") or name.endswith(".json"):
            lines = list(text_lines(path))
            if name.endswith(".json"):
                text = "".join(t for _, t in lines)
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as err:
                    # Not one JSON document: maybe JSON Lines in a .json file; check line by line.
                    if "Extra data" not in err.msg:
                        return f"invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}"
                else:
                    if isinstance(data, list) and not all(isinstance(r, dict) for r in data):
                        return "a JSON array must hold one object per row"
                    return None if data else "the file holds no rows"
            rows = 0
            for number, text in lines:
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as err:
                    return f"invalid JSON on line {number}, column {err.colno}: {err.msg}"
                if not isinstance(obj, dict):
                    return f"line {number} is a JSON {type(obj).__name__}, expected an object per line"
                rows += 1
            return None if rows else "the file holds no rows"
        delimited = delimiter_of(path)
        if delimited is not None:
            delimiter, quoting = delimited
            records = csv_records(path, delimiter, quoting)
            header = next(records, None)
            if header is None:
                return "the file has no header row"
            names = header[2]
            twice = next((c for i, c in enumerate(names) if c in names[:i]), None)
            if twice is not None:
                return f"line {header[0]}: column name {twice!r} appears twice in the header; rename one"
            rows = 0
            for first, last, row in records:
                rows += 1
                if len(row) == len(names):
                    continue
                where = f"line {first}" if first == last else f"line {first} (a row running to line {last})"
                advice = (
                    "TSV has no quoting: a cell cannot hold a tab or a line break (remove them, or write the data "
                    "as .csv or .jsonl)"
                    if quoting == csv.QUOTE_NONE
                    else "quote fields that contain the delimiter, and check the row's quotes are balanced"
                )
                return f"{where}: {len(row)} fields, but the header has {len(names)} ({', '.join(names)}); {advice}"
            return None if rows else "the file holds a header but no rows"
    except ValueError as err:
        return str(err)
    return None
