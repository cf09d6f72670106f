"""The ``file`` source kind: one file, a folder, a glob or a list of shards, read as one table.

Formats: JSON Lines, JSON, CSV/TSV (optionally gzipped) and Parquet, through ``datasets``' builders.
Shards must agree on format and columns; a failure is named by shard (:mod:`cembed.data.sources.diagnose`).
"""

from __future__ import annotations

import functools
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cembed.config.sources import (
    LOCAL_EXTENSIONS,
    FileSource,
    is_glob,
)
from cembed.data.sources.diagnose import diagnosis
from cembed.data.sources.logs import captured_library_logs, file_named_in, library_cause
from cembed.data.sources.text import (
    check_codec,
    csv_header,
    csv_records,
    datasets_string_features,
    delimiter_of,
    foreign_compression,
    inner_name,
    read_jsonl_rows,
    text_lines,
    unreadable_compression,
)
from cembed.errors import UserError
from cembed.files import display_path

SUPPORTED_FILES = ".jsonl, .json, .csv, .tsv (each also .gz, .bz2, .xz or .zst) or .parquet"


def builder_for(path: Path) -> tuple[str, dict]:
    """The ``datasets`` builder and its options for a file, by extension; UserError if unsupported.

    CSV and TSV go to the ``csv`` builder (pandas) with every column read as text as written (a
    text file carries no types: ``007`` stays ``007``) and no NA words (pandas' defaults would
    turn cells reading ``nan``, ``None``, ``NA``, ``null`` ... into missing values): only an empty
    cell is missing, so the cell checks name it as empty."""
    name = inner_name(path)
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
    if foreign_compression(path):
        raise UserError(unreadable_compression(path))
    raise UserError(f"{path}: unsupported file type; use {SUPPORTED_FILES}")


@dataclass(frozen=True)
class Shards:
    """What a file source reads (:func:`resolve_shards`).

    Attributes:
        files: the files read, in the order their rows are read.
        skipped: what the folder, glob or list held that is not read, each ``"<path> (<why>)"``, the
            path relative to the folder (or the glob's folder): hidden or underscore-prefixed folders
            (one entry each, with their file count), marker and hidden files, files that are not
            data, and shards holding 0 rows (Spark writes one per empty partition).
    """

    files: list[Path]
    skipped: tuple[str, ...] = ()


def is_sharded(source: FileSource) -> bool:
    """Whether a file source names its shards: a list of files, a folder, or a glob (a path that
    exists as written is the file itself, even with ``[`` in its name)."""
    if isinstance(source.path, list):
        return True
    path = Path(source.path)
    return path.is_dir() or (is_glob(source.path) and not path.exists())


def shard_count(source: FileSource) -> int | None:
    """How many files a sharded file source reads (:func:`source_files`: skipped paths and 0-row
    shards not counted), for the run summary and ``validate``; None for one file given as itself
    (the file kind's ``count_files`` hook).

    Raises:
        UserError: see :func:`source_files`.
    """
    return len(source_files(source)) if is_sharded(source) else None


def skipped_files(source: FileSource) -> tuple[str, ...]:
    """What a sharded file source holds but does not read, each ``"<path> (<why>)"``
    (:attr:`Shards.skipped`); ``()`` for one file (the file kind's ``skipped_files`` hook).

    Raises:
        UserError: see :func:`source_files`.
    """
    return resolve_shards(source).skipped if is_sharded(source) else ()


def source_files(source: FileSource) -> list[Path]:
    """The files of a file source, in the order their rows are read (:attr:`Shards.files` of
    :func:`resolve_shards`).

    Raises:
        UserError: see :func:`resolve_shards`.
    """
    return resolve_shards(source).files


def resolve_shards(source: FileSource) -> Shards:
    """The files of a file source and what it skips: the file itself; a folder's data files
    (recursively) or a glob's matches, sorted by path, as ``datasets``' own data-files resolution
    (:func:`datasets.data_files.resolve_pattern`) finds them, which leaves out hidden files and
    folders (``.ipynb_checkpoints/``, ``.part-0.crc``), less the paths under an underscore-prefixed
    name (Spark's and Hadoop's ``_temporary/`` attempts, ``_SUCCESS``) and files of another type; a
    list's files as listed. A shard that holds 0 rows is skipped too (a 0-byte file, a CSV header
    alone, a parquet file of 0 rows), unless every shard does.

    A glob that names a hidden or underscore-prefixed part itself (``data/_staging/*.jsonl``,
    ``.cache/*.parquet``) reads it, as ``datasets`` does for hidden parts.

    Raises:
        UserError: a folder or glob with no supported data file (naming it), a listed file that is
            missing or a folder, shards that all hold 0 rows.
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
        return without_empty_shards(files, [], display_path(source.label))
    if not is_sharded(source):
        return Shards([Path(source.path)])
    if is_glob(source.path) and not Path(source.path).exists():
        pattern = os.path.abspath(source.path)
        base = Path(literal_prefix(pattern))
        what = "no {} file matches this pattern"
    else:
        base = Path(os.path.abspath(source.path))
        pattern = os.path.join(glob.escape(str(base)), "**")
        what = "the folder holds no {} file"
    files, skipped = _resolve_pattern(pattern, base)
    foreign = next((path for path, why in skipped if why == "type" and foreign_compression(path)), None)
    if foreign is not None:  # a shard of the data, not a stray file: never skipped while its siblings train
        raise UserError(unreadable_compression(foreign))
    if not files:
        shown = display_path(source.path)
        raise UserError(f"{shown}: {what.format(SUPPORTED_FILES)}" + _skipped_note(_grouped(skipped, base)))
    return without_empty_shards(files, _grouped(skipped, base), display_path(source.label), base)


def literal_prefix(pattern: str) -> str:
    """The folder of a glob pattern before its first wildcard part (``/d/x/**/*.jsonl`` -> ``/d/x``)."""
    parts = Path(pattern).parts
    literal = next(i for i, part in enumerate(parts) if is_glob(part))
    return str(Path(*parts[:literal])) if literal else os.sep


def _prefixed(path: str, mark: str) -> int:
    """How many parts of ``path`` start with ``mark`` (``.`` and ``..`` are not hidden)."""
    return sum(1 for part in Path(path).parts if part.startswith(mark) and set(part) != {"."})


def _resolve_pattern(pattern: str, base: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """``(data files sorted by path, [(skipped file, why)])`` of the files ``pattern`` matches:
    ``datasets``' resolution decides what is hidden or not data to it; a path with more
    underscore-prefixed parts than the pattern names (the rule Spark and Hadoop readers apply) and a
    file of another type are left out here."""
    from datasets.data_files import resolve_pattern
    from fsspec.implementations.local import LocalFileSystem

    try:
        kept = {os.path.abspath(p) for p in resolve_pattern(pattern, base_path=str(base))}
    except FileNotFoundError:
        kept = set()
    matched = sorted(Path(p) for p, info in LocalFileSystem().glob(pattern, detail=True).items() if os.path.isfile(p))
    files, skipped = [], []
    for path in matched:
        if str(path) not in kept:
            why = "hidden" if _prefixed(str(path), ".") > _prefixed(pattern, ".") else "datasets"
        elif _prefixed(str(path), "_") > _prefixed(pattern, "_"):
            why = "underscore"
        elif not path.name.lower().endswith(LOCAL_EXTENSIONS):
            why = "type"
        else:
            files.append(path)
            continue
        skipped.append((path, why))
    return files, skipped


_WHY = {
    "hidden": "hidden",
    "underscore": "underscore-prefixed: Spark/Hadoop bookkeeping",
    "datasets": "left out by datasets' data-files resolution",
    "type": "not a data file",
}


def _grouped(skipped: list[tuple[Path, str]], base: Path) -> list[str]:
    """Skipped files as ``"<path> (<why>)"`` relative to ``base``, a hidden or underscore-prefixed
    folder once (``_temporary/ (underscore-prefixed folder: ..., 3 files)``) rather than per file."""
    folders: dict[str, tuple[str, int]] = {}
    out: list[str] = []
    for path, why in skipped:
        rel = path.relative_to(base) if path.is_relative_to(base) else path
        mark = {"hidden": ".", "underscore": "_"}.get(why)
        folder = next((i for i, part in enumerate(rel.parts[:-1]) if mark and part.startswith(mark)), None)
        if folder is None:
            out.append(f"{rel.as_posix()} ({_WHY[why]})")
            continue
        name = Path(*rel.parts[: folder + 1]).as_posix() + "/"
        if name not in folders:
            out.append(name)
        folders[name] = (why, folders.get(name, (why, 0))[1] + 1)
    for i, entry in enumerate(out):
        if entry in folders:
            why, count = folders[entry]
            kind = _WHY[why].replace(":", " folder:", 1) if ":" in _WHY[why] else f"{_WHY[why]} folder"
            out[i] = f"{entry} ({kind}, {count} file{'s' if count != 1 else ''})"
    return out


def _skipped_note(skipped: list[str] | tuple[str, ...]) -> str:
    return f"; skipped: {', '.join(skipped)}" if skipped else ""


def without_empty_shards(files: list[Path], skipped: list[str], label: str, base: Path | None = None) -> Shards:
    """``files`` less the shards that hold 0 rows (each added to ``skipped`` as ``<shard> (0 rows)``).

    Raises:
        UserError: every shard holds 0 rows.
    """
    kept, empty = [], []
    for path in files:
        (empty if _holds_no_rows(path) else kept).append(path)
    if not kept:
        raise UserError(
            f"{label}: every data file holds 0 rows ({len(files)} file{'s' if len(files) != 1 else ''})"
            + _skipped_note(skipped)
        )
    for path in empty:
        rel = path.relative_to(base) if base is not None and path.is_relative_to(base) else Path(display_path(path))
        skipped.append(f"{rel.as_posix()} (0 rows)")
    return Shards(kept, tuple(skipped))


def _holds_no_rows(path: Path) -> bool:
    """Whether a data file holds no row, read cheaply: 0 bytes; JSON Lines with no non-blank line; a
    CSV/TSV header alone; a JSON document ``[]``; a parquet file whose metadata counts 0 rows. A file
    that cannot be read is not judged empty here: the load names its problem. Remembered per file
    version (size, modification time): a source's shards are resolved by each stage that asks."""
    try:
        stat = path.stat()
    except OSError:
        return False
    return stat.st_size == 0 or _read_no_rows(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=65_536)
def _read_no_rows(file: str, size: int, mtime_ns: int) -> bool:
    """:func:`_holds_no_rows` of a non-empty file (``size`` and ``mtime_ns`` key its version)."""
    path = Path(file)
    try:
        name = inner_name(path)
        if name.endswith(".jsonl"):
            return not any(text.strip() for _, text in text_lines(path))
        if name.endswith(".json"):
            if size > 65_536:
                return False
            return "".join(t for _, t in text_lines(path)).strip() in ("", "[]")
        delimited = delimiter_of(path)
        if delimited is not None:
            records = csv_records(path, *delimited)
            return next(records, None) is None or next(records, None) is None
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows == 0
    except Exception:  # noqa: BLE001 - an unreadable file is named by the load's diagnosis
        return False
    return False


def shard_format(path: Path) -> str:
    """A shard's format for the one-format rule: ``.jsonl`` and ``.jsonl.gz`` (and ``.json``) are one."""
    name = inner_name(path)
    return ".jsonl" if name.endswith(".json") else Path(name).suffix


def _shard_columns(path: Path) -> list[str] | None:
    """A shard's column names, read cheaply: a JSON Lines file's first record's keys, a CSV/TSV
    header, a parquet file's schema; None where that is unknown without reading it all (.json) or
    unreadable (the load names the problem)."""
    name = inner_name(path)
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


def check_shards(files: list[Path], label: str) -> None:
    """Refuse shards that cannot be one source, naming the first offending one: a missing file, a
    second format, columns that differ from the first shard's. (A loaded and a streamed source
    alike: :func:`load_file`, :func:`cembed.data.sources.file_stream.open_file_stream`.)"""
    first_format = shard_format(files[0])
    first_columns: list[str] | None = None
    for path in files:
        shown = display_path(path)
        if not path.exists():
            raise UserError(f"{shown}: data file not found")
        if shard_format(path) != first_format:
            raise UserError(
                f"{label}: {shown}: a {shard_format(path)} file among {first_format} files ({display_path(files[0])}); "
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
    :func:`resolve_shards`), as one ``datasets.Dataset`` (one split, all rows, shards in path order).

    Raises:
        UserError: missing file, an empty file, unsupported extension, or unreadable/corrupt content
            (named by :func:`diagnose_file` where it can: shard, line, column, cause; else the shard
            the library failed on and the library's own cause); a folder or glob with no data file;
            shards of two formats or with different columns (naming the first shard that differs).
    """
    import datasets

    datasets.disable_progress_bars()
    sharded = is_sharded(source)
    files = source_files(source)
    for file in files:
        check_codec(file)
    path = files[0]
    shown = display_path(source.label if sharded else path)
    if sharded:
        check_shards(files, shown)
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
        with captured_library_logs() as records:  # a parser failure is named below, in one line
            dataset = datasets.load_dataset(builder, data_files=data_files, split="train", **kwargs)
        # The JSON reader can pass invalid UTF-8 through into string columns; catch it here.
        dataset.data.table.validate(full=True)
        return dataset
    except Exception as err:  # datasets wraps parser errors in many types
        problem = diagnosis(files)
        if problem is None and all(inner_name(f).endswith(".jsonl") for f in files):
            # datasets' mixed-type fallback chokes on blank lines; the standard library does not.
            return read_jsonl_rows(*files)
        if problem is None:
            problem = _read_failure(files, builder, kwargs, err, records)
        raise UserError(f"{shown}: {problem}") from None


def _read_failure(files: list[Path], builder: str, kwargs: dict, err: Exception, records) -> str:
    """Why ``datasets`` could not read ``files`` as one table, in one line keeping the library's
    cause (:func:`library_cause`) and, with several files, naming the shard: the one the library's
    log names, else the first that fails read alone, else the first whose column types differ
    from the first shard's (each reads, but not together)."""
    import datasets

    cause = f"cannot read as {builder}: {library_cause(err)}"
    if len(files) == 1:
        return cause
    named = file_named_in(records, [str(f) for f in files])
    if named is not None:
        return f"{display_path(named)}: {cause}"
    features = []
    for path in files:
        try:
            with captured_library_logs():
                alone = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
        except Exception as own:  # noqa: BLE001 - this shard is the one that cannot be read
            return f"{display_path(path)}: cannot read as {builder}: {library_cause(own)}"
        features.append(alone.features)
        if features[-1] != features[0]:
            ours = ", ".join(f"{k}: {v}" for k, v in _feature_types(features[-1]).items())
            first = ", ".join(f"{k}: {v}" for k, v in _feature_types(features[0]).items())
            return (
                f"{display_path(path)}: column types ({ours}) differ from {display_path(files[0])}'s ({first}); "
                "every shard of one source needs the same column types"
            )
    return cause


def _feature_types(features) -> dict[str, str]:
    """``{column: type}`` of ``datasets.Features``, as messages show them (``string``, ``list of int64``)."""
    return {name: _feature_type(f) for name, f in features.items()}


def _feature_type(feature) -> str:
    inner = getattr(feature, "feature", None)  # datasets.List / Sequence
    if inner is not None:
        return f"list of {_feature_type(inner)}"
    return str(getattr(feature, "dtype", type(feature).__name__))
