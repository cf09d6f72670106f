"""The ``file`` source kind: one file, a folder, a glob or a list of shards, read as one table.

Formats: JSON Lines, JSON, CSV/TSV (optionally gzipped) and Parquet, through ``datasets``' builders.
Shards must agree on format and columns; a failure is named by shard (:mod:`cembed.data.sources.diagnose`).
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

from cembed.config.sources import (
    LOCAL_EXTENSIONS,
    FileSource,
    is_glob,
)
from cembed.data.sources.diagnose import diagnosis
from cembed.data.sources.logs import captured_library_logs
from cembed.data.sources.text import csv_header, datasets_string_features, delimiter_of, read_jsonl_rows, text_lines
from cembed.errors import UserError, first_line
from cembed.files import display_path


def builder_for(path: Path) -> tuple[str, dict]:
    """The ``datasets`` builder and its options for a file, by extension; UserError if unsupported.

    CSV and TSV go to the ``csv`` builder (pandas) with every column read as text as written (a
    text file carries no types: ``007`` stays ``007``) and no NA words (pandas' defaults would
    turn cells reading ``nan``, ``None``, ``NA``, ``null`` ... into missing values): only an empty
    cell is missing, so the cell checks name it as empty."""
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".json")):
        return "json", {}
    delimited = delimiter_of(path)
    if delimited is not None:
        delimiter, quoting = delimited
        header = csv_header(path, delimiter, quoting)
        features = datasets_string_features(header) if header else None
        return "csv", {
            "sep": delimiter,
            "quoting": quoting,
            "keep_default_na": False,
            "na_values": [""],
            "features": features,
        }
    if name.endswith(".parquet"):
        return "parquet", {}
    raise UserError(f"{path}: unsupported file type; use .jsonl[.gz], .json, .csv, .tsv or .parquet")


SUPPORTED_FILES = ".jsonl[.gz], .json[.gz], .csv[.gz], .tsv[.gz] or .parquet"


def _is_data_file(path: Path) -> bool:
    """A file a folder or glob contributes as a shard: a supported extension, not hidden or a
    marker (``.crc``, ``_SUCCESS``: what Spark and others write beside their shards)."""
    return path.is_file() and not path.name.startswith((".", "_")) and path.name.lower().endswith(LOCAL_EXTENSIONS)


def is_sharded(source: FileSource) -> bool:
    """Whether a file source names its shards: a list of files, a folder, or a glob (a path that
    exists as written is the file itself, even with ``[`` in its name)."""
    if isinstance(source.path, list):
        return True
    path = Path(source.path)
    return path.is_dir() or (is_glob(source.path) and not path.exists())


def shard_count(source: FileSource) -> int | None:
    """How many files a sharded file source reads (:func:`source_files`), for the run summary and
    ``validate``; None for one file given as itself (the file kind's ``count_files`` hook).

    Raises:
        UserError: see :func:`source_files`.
    """
    return len(source_files(source)) if is_sharded(source) else None


def source_files(source: FileSource) -> list[Path]:
    """The files of a file source, in the order their rows are read: the file itself; a folder's
    data files (recursively) or a glob's matches, sorted by path; a list's files as listed.

    Raises:
        UserError: a folder or glob with no supported data file (naming it), a listed file that is
            missing or a folder.
    """
    if isinstance(source.path, list):
        files = [Path(p) for p in source.path]
        for path in files:
            if not path.exists():
                raise UserError(
                    f"{display_path(path)}: data file not found (data paths resolve relative to the config file)"
                )
            if path.is_dir():
                raise UserError(f"{display_path(path)}: is a folder; a list of shards names files")
        return files
    if not is_sharded(source):
        return [Path(source.path)]
    if is_glob(source.path) and not Path(source.path).exists():
        found = sorted(p for p in map(Path, glob.glob(source.path, recursive=True)) if _is_data_file(p))
        if not found:
            raise UserError(f"{display_path(source.path)}: no {SUPPORTED_FILES} file matches this pattern")
        return found
    path = Path(source.path)
    found = sorted(p for p in path.rglob("*") if _is_data_file(p))
    if not found:
        raise UserError(f"{display_path(path)}: the folder holds no {SUPPORTED_FILES} file")
    return found


def _format(path: Path) -> str:
    """A shard's format for the one-format rule: ``.jsonl`` and ``.jsonl.gz`` (and ``.json``) are one."""
    name = path.name.lower().removesuffix(".gz")
    return ".jsonl" if name.endswith(".json") else Path(name).suffix


def _shard_columns(path: Path) -> list[str] | None:
    """A shard's column names, read cheaply: a JSON Lines file's first record's keys, a CSV/TSV
    header, a parquet file's schema; None where that is unknown without reading it all (.json) or
    unreadable (the load names the problem)."""
    name = path.name.lower().removesuffix(".gz")
    try:
        if name.endswith(".jsonl"):
            for _, text in text_lines(path):
                if text.strip():
                    record = json.loads(text)
                    return list(record) if isinstance(record, dict) else None
            return None
        delimited = delimiter_of(path)
        if delimited is not None:
            return csv_header(path, *delimited)
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
    except Exception:  # noqa: BLE001 - an unreadable shard is named by the load's diagnosis
        return None
    return None


def _check_shards(files: list[Path], label: str) -> None:
    """Refuse shards that cannot be one source, naming the first offending one: a missing or empty
    file, a second format, columns that differ from the first shard's."""
    first_format = _format(files[0])
    first_columns: list[str] | None = None
    for path in files:
        shown = display_path(path)
        if not path.exists():
            raise UserError(f"{shown}: data file not found")
        if path.stat().st_size == 0:
            raise UserError(f"{label}: {shown}: data file is empty; remove it or fill it")
        if _format(path) != first_format:
            raise UserError(
                f"{label}: {shown}: a {_format(path)} file among {first_format} files ({display_path(files[0])}); "
                "one source holds one format: convert it, or make the formats two sources"
            )
        columns = _shard_columns(path)
        if columns is None:
            continue
        if first_columns is None:
            first_columns, first_path = columns, path
        elif set(columns) != set(first_columns):
            raise UserError(
                f"{label}: {shown}: columns {', '.join(columns)} differ from {display_path(first_path)}'s "
                f"({', '.join(first_columns)}); every shard of one source needs the same columns"
            )


def load_file(source: FileSource):
    """Load a local data file, or a sharded one (a folder, a glob, a list of files: see
    :func:`source_files`), as one ``datasets.Dataset`` (one split, all rows, shards in path order).

    Raises:
        UserError: missing file, an empty file, unsupported extension, or unreadable/corrupt content
            (named by :func:`diagnose_file` where it can: shard, line, column, cause); a folder or
            glob with no data file; shards of two formats or with different columns (naming the
            first shard that differs).
    """
    import datasets

    datasets.disable_progress_bars()
    sharded = is_sharded(source)
    files = source_files(source)
    path = files[0]
    shown = display_path(source.label if sharded else path)
    if sharded:
        _check_shards(files, shown)
    elif not path.exists():
        raise UserError(f"{shown}: data file not found (data paths resolve relative to the config file)")
    elif path.stat().st_size == 0:
        raise UserError(f"{shown}: data file is empty")
    # datasets pings the hub to count a download of its json/csv/parquet builder on every load; a local
    # file is nobody's download, and without network the ping costs a timeout.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    builder, kwargs = builder_for(path)
    if builder == "csv":
        # pandas fills short rows with NaN silently; a ragged row must be named instead.
        problem = diagnosis(files)
        if problem:
            raise UserError(f"{shown}: {problem}")
    data_files = str(path) if not sharded else [str(f) for f in files]
    try:
        with captured_library_logs():  # a parser failure is named below, in one line
            dataset = datasets.load_dataset(builder, data_files=data_files, split="train", **kwargs)
        # The JSON reader can pass invalid UTF-8 through into string columns; catch it here.
        dataset.data.table.validate(full=True)
        return dataset
    except Exception as err:  # datasets wraps parser errors in many types
        problem = diagnosis(files)
        if problem is None and all(f.name.lower().removesuffix(".gz").endswith(".jsonl") for f in files):
            # datasets' mixed-type fallback chokes on blank lines; the standard library does not.
            return read_jsonl_rows(*files)
        if problem is None:
            problem = f"cannot read as {builder}: {first_line(err)}"
        raise UserError(f"{shown}: {problem}") from None
