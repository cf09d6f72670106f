"""Training-data sources: one loader per source kind, each returning a ``datasets.Dataset``.

A source kind is a config class in :mod:`cembed.config.data` (a :class:`~cembed.config.data.SourceConfig`
subclass registered with :func:`~cembed.config.data.register_source_config`: :class:`~cembed.config.data.FileSource`,
:class:`~cembed.config.data.HubSource`, :class:`~cembed.config.data.BeirSource`) plus a loader here registered
with :func:`register_source_loader` (in :data:`LOADERS`); :func:`load_source` dispatches on the source's
``kind``. A file is scanned with the standard library (:func:`diagnose_file`) so a malformed one is
refused with its line, not a parser traceback.
"""

from __future__ import annotations

import csv
import glob
import gzip
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cembed.config.data import (
    LOCAL_EXTENSIONS,
    BeirSource,
    FileSource,
    HubSource,
    PreparedSource,
    SourceConfig,
    is_glob,
)
from cembed.data.beir import beir_files, qrels_lines, read_corpus, read_queries
from cembed.errors import HubUnavailable, UserError, first_line
from cembed.files import display_path


def _delimited(path: Path) -> tuple[str, int] | None:
    """``(delimiter, csv quoting)`` of a CSV or TSV file, by extension; None for other files. A TSV
    cell is exactly its bytes between tabs: no quote processing (``csv.QUOTE_NONE``)."""
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".csv"):
        return ",", csv.QUOTE_MINIMAL
    if name.endswith(".tsv"):
        return "\t", csv.QUOTE_NONE
    return None


def builder_for(path: Path) -> tuple[str, dict]:
    """The ``datasets`` builder and its options for a file, by extension; UserError if unsupported.

    CSV and TSV go to the ``csv`` builder (pandas) with every column read as text as written (a
    text file carries no types: ``007`` stays ``007``) and no NA words (pandas' defaults would
    turn cells reading ``nan``, ``None``, ``NA``, ``null`` ... into missing values): only an empty
    cell is missing, so the cell checks name it as empty."""
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".json")):
        return "json", {}
    delimited = _delimited(path)
    if delimited is not None:
        delimiter, quoting = delimited
        header = _csv_header(path, delimiter, quoting)
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


def datasets_string_features(names: list[str]):
    """``datasets.Features`` of text columns named ``names``."""
    import datasets

    return datasets.Features({name: datasets.Value("string") for name in names})


def _csv_header(path: Path, delimiter: str, quoting: int) -> list[str] | None:
    """The header row of a CSV/TSV file (None: unreadable; :func:`diagnose_file` says why)."""
    try:
        return next(csv.reader((t for _, t in _text_lines(path)), delimiter=delimiter, quoting=quoting), None)
    except (ValueError, csv.Error):
        return None


def _csv_records(path: Path, delimiter: str, quoting: int):
    """Yield ``(first line, last line, fields)`` of each record of a CSV/TSV file, header included,
    blank lines skipped (as the reader skips them); ValueError naming the line for bad bytes, a
    quote never closed, or a line break inside a TSV cell."""
    reader = csv.reader((t for _, t in _text_lines(path)), delimiter=delimiter, quoting=quoting, strict=True)
    last = 0
    while True:
        try:
            row = next(reader, None)
        except csv.Error as err:
            start = last + 1
            if "end of data" in str(err) or "EOF" in str(err):
                raise ValueError(
                    f"line {start}: a quote opened in this row is never closed (it runs to the end of the file); "
                    'close it, or write a quote inside a quoted field as two ("")'
                ) from None
            raise ValueError(
                f"line {reader.line_num}: malformed {'TSV' if quoting == csv.QUOTE_NONE else 'CSV'}: {err}"
            ) from None
        if row is None:
            return
        first, last = last + 1, reader.line_num
        if row:
            yield first, last, row


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
            for _, text in _text_lines(path):
                if text.strip():
                    record = json.loads(text)
                    return list(record) if isinstance(record, dict) else None
            return None
        delimited = _delimited(path)
        if delimited is not None:
            return _csv_header(path, *delimited)
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


def _diagnosis(files: list[Path]) -> str | None:
    """The first problem :func:`diagnose_file` finds in ``files``, prefixed by the shard when there are several."""
    for path in files:
        problem = diagnose_file(path)
        if problem:
            return f"{display_path(path)}: {problem}" if len(files) > 1 else problem
    return None


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
        problem = _diagnosis(files)
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
        problem = _diagnosis(files)
        if problem is None and all(f.name.lower().removesuffix(".gz").endswith(".jsonl") for f in files):
            # datasets' mixed-type fallback chokes on blank lines; the standard library does not.
            return _read_jsonl_rows(*files)
        if problem is None:
            first = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
            problem = f"cannot read as {builder}: {first[:300]}"
        raise UserError(f"{shown}: {problem}") from None


def load_hub(source: HubSource):
    """Load ``source.split`` of a hub dataset (``source.subset`` its configuration) as a ``datasets.Dataset``.

    Raises:
        HubUnavailable: the hub is offline or unreachable (and the dataset is not cached).
        UserError: the dataset, subset or split cannot be loaded (unknown id, ...).
    """
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(source.path, source.subset, split=source.split)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
        message = (
            f"data: cannot load hub dataset {source.path!r} (subset={source.subset}, split={source.split}): "
            f"{first[:300]}"
        )
        # datasets raises the builtin ConnectionError both offline and when the hub cannot be reached.
        if isinstance(err, ConnectionError):
            raise HubUnavailable(message, source.path, hub_unavailable_reason(first)) from None
        raise UserError(message) from None


def hub_unavailable_reason(error_line: str) -> str:
    """Why the hub could not serve a dataset: ``offline: HF_DATASETS_OFFLINE=1`` (naming the variable
    that switched offline mode on), or ``hub unreachable: <the library's message>``."""
    import datasets

    if datasets.config.HF_HUB_OFFLINE:
        for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            value = os.environ.get(var, "")
            if value.upper() in ("1", "ON", "YES", "TRUE"):
                return f"offline: {var}={value}"
        return "offline mode"
    return f"hub unreachable: {error_line[:200]}"


def _read_jsonl_rows(*paths: Path):
    """JSON Lines files (one, or a source's shards in order) read with the standard library (they
    parsed in :func:`diagnose_file`) as a
    ``datasets.Dataset``: a column of text (or null) cells is a string column; any other column is
    kept as JSON text in pyarrow's ``json`` type, as ``datasets`` does for mixed columns, so the cell
    checks can name its non-text cells."""
    import datasets
    import pyarrow as pa

    rows = [json.loads(text) for path in paths for _, text in _text_lines(path) if text.strip()]
    names = list(dict.fromkeys(k for row in rows for k in row))
    columns = {}
    for name in names:
        values = [row.get(name) for row in rows]
        if all(v is None or isinstance(v, str) for v in values):
            columns[name] = pa.array(values, type=pa.string())
        else:
            cells = [None if v is None or v != v else json.dumps(v, ensure_ascii=False) for v in values]
            columns[name] = pa.array(cells, type=pa.json_())
    return datasets.Dataset(datasets.table.InMemoryTable(pa.table(columns)))


def load_beir_pairs(source: BeirSource):
    """(query, document) training pairs from a BEIR folder's ``qrels/<split>.tsv``, in file order:
    ``anchor`` is the query text, ``positive`` the document as ``(title + " " + text).strip()`` (the
    evaluator's rule, :func:`cembed.data.beir.document_text`), plus ``query_id`` and ``doc_id``. Rows
    with score <= 0 are left out; a repeated (query, document) line counts once (its last score).
    A document relevant to several queries appears in several rows: the no-duplicates sampler keeps
    them in different batches.

    Raises:
        UserError: a missing folder or file (see :func:`cembed.data.beir.beir_files`), a bad corpus,
            queries or qrels line, a qrels line naming a query or document that does not exist (file
            and line), or no pair with a positive score.
    """
    import datasets

    corpus_path, queries_path, qrels_path = beir_files(source.path, source.split)
    corpus, queries = read_corpus(corpus_path), read_queries(queries_path)
    pairs: dict[tuple[str, str], int] = {}
    for n, qid, cid, score in qrels_lines(qrels_path):
        if qid not in queries:
            raise UserError(f"{qrels_path}:{n}: query-id {qid!r} is not in {queries_path.name}")
        if cid not in corpus:
            raise UserError(f"{qrels_path}:{n}: corpus-id {cid!r} (query {qid!r}) is not in {corpus_path.name}")
        pairs.pop((qid, cid), None)  # a repeated line takes the later position and score
        pairs[(qid, cid)] = score
    kept = [key for key, score in pairs.items() if score > 0]
    if not kept:
        raise UserError(f"{qrels_path}: no (query, document) pair with score > 0; nothing to train on")
    return datasets.Dataset.from_dict(
        {
            "anchor": [queries[q] for q, _ in kept],
            "positive": [corpus[d] for _, d in kept],
            "query_id": [q for q, _ in kept],
            "doc_id": [d for _, d in kept],
        }
    )


def load_prepared(source: PreparedSource):
    """A prepared source's token ids (:mod:`cembed.data.prepared`) as one ``datasets.Dataset``:
    the manifest read and checked against the parts (:func:`cembed.data.prepared.read_manifest`),
    each part memory-mapped (``Dataset.from_file``, no copy), concatenated in order. The manifest
    is the dataset's ``cembed_manifest`` attribute (its role columns, tokenizer, prompts, samples).

    Raises:
        UserError: no manifest, a missing or resized part, a fingerprint that does not match (see
            ``read_manifest``), a part that is not an Arrow stream, parts without a role's
            ``<role>_input_ids`` column or with other columns than the first part's, or rows that
            differ from the manifest's (naming the part).
    """
    import datasets

    from cembed.data.collator import TOKEN_SUFFIX
    from cembed.data.prepared import read_manifest

    datasets.disable_progress_bars()
    folder = Path(source.path)
    manifest = read_manifest(folder)
    parts = []
    for part in manifest.parts:
        where = f"{display_path(folder)}: part {part.file}"
        try:
            with captured_library_logs():
                table = datasets.Dataset.from_file(str(folder / part.file), in_memory=False)
        except Exception as err:  # pyarrow's ArrowInvalid and others: not an Arrow stream
            raise UserError(f"{where}: not an Arrow stream file ({first_line(err, 200)}); prepare it again") from None
        if len(table) != part.rows:
            raise UserError(f"{where}: holds {len(table)} rows, the manifest says {part.rows}; prepare it again")
        missing = [c + TOKEN_SUFFIX for c in manifest.columns if c + TOKEN_SUFFIX not in table.column_names]
        if missing:
            raise UserError(
                f"{where}: no column {missing[0]} (columns: {', '.join(table.column_names)}); prepare it again"
            )
        parts.append(table)
    if not parts:
        raise UserError(f"{display_path(folder)}: the prepared source has no parts; nothing to train on")
    for part, table in zip(manifest.parts, parts):
        if table.features != parts[0].features:
            raise UserError(
                f"{display_path(folder)}: part {part.file}'s columns ({', '.join(table.column_names)}) differ from "
                f"{manifest.parts[0].file}'s ({', '.join(parts[0].column_names)}); prepare it again"
            )
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    dataset.cembed_manifest = manifest
    return dataset


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
    name = path.name.lower().removesuffix(".gz")
    try:
        if name.endswith(".jsonl"):
            return sum(1 for _, text in _text_lines(path) if text.strip())
        delimited = _delimited(path)
        if delimited is not None:
            return max(sum(1 for _ in _csv_records(path, *delimited)) - 1, 0)
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
        if name.endswith(".json"):
            data = json.loads("".join(t for _, t in _text_lines(path)))
            return len(data) if isinstance(data, list) else None
    except Exception:  # noqa: BLE001 - a locator falls back to the row's global number
        return None
    return None


def _one_file_locator(path: Path) -> Callable[[int], str]:
    """:func:`file_row_locator` of one file."""
    delimited = _delimited(path)
    if delimited is not None:

        def locate_record(index: int) -> str:
            try:
                for number, (first, _, _) in enumerate(_csv_records(path, *delimited), start=-1):
                    if number == index:
                        return f"line {first}"
            except ValueError:
                pass
            return row_number(index)

        return locate_record
    if not path.name.lower().removesuffix(".gz").endswith(".jsonl"):
        return row_number

    def locate(index: int) -> str:
        rows = -1
        try:
            for number, text in _text_lines(path):
                rows += bool(text.strip())
                if rows == index:
                    return f"line {number}"
        except ValueError:
            pass
        return row_number(index)

    return locate


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
    kind ``kind`` (the ``kind`` of a class registered with :func:`cembed.config.data.register_source_config`).

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
            f"no loader registered for {type(source).__name__} (kind {source.kind!r}) in cembed.data.sources.LOADERS"
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


def _text_lines(path: Path):
    """Yield ``(line_number, text)``; raises ValueError naming the line for bad gzip or UTF-8."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(
                        f"line {number}: bytes that are not UTF-8 at column {err.start + 1}; re-encode the file as UTF-8"
                    ) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise ValueError(f"corrupt or truncated gzip ({err.__class__.__name__}: {err}); re-create the file") from None
    except PermissionError:
        raise ValueError("cannot read the file: permission denied") from None


def diagnose_file(path: Path) -> str | None:
    """Scan a local data file with the standard library and describe its first problem, or return
    ``None`` when it parses: corrupt/truncated gzip, non-UTF-8 bytes, invalid JSON on line N, a JSON
    line that is not an object, a CSV/TSV row whose field count differs from the header's, no rows."""
    name = path.name.lower().removesuffix(".gz")
    try:
        if name.endswith(".jsonl") or name.endswith(".json"):
            lines = list(_text_lines(path))
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
        delimited = _delimited(path)
        if delimited is not None:
            delimiter, quoting = delimited
            records = _csv_records(path, delimiter, quoting)
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
