"""Reading text data files with the standard library: lines, CSV headers and records, the delimiter.

Used where ``datasets``' own readers give no usable message (a bad line, a stray delimiter) or would
read more than needed (a header).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import zlib
from pathlib import Path

from cembed.config.sources import COMPRESSIONS
from cembed.errors import UserError
from cembed.files import display_path

# Compression and archive suffixes a data file may carry that cembed does not read (datasets' and
# fsspec's other codecs): such a file is refused by name, never skipped as "not a data file".
FOREIGN_COMPRESSIONS = (".lz4", ".lzma", ".zip", ".tar", ".tgz", ".7z", ".rar", ".sz", ".snappy", ".br", ".zstd", ".bz")
TEXT_FORMATS = (".jsonl", ".json", ".csv", ".tsv")
READABLE = (
    "cembed reads JSON Lines, JSON, CSV and TSV plain or compressed with "
    + ", ".join(COMPRESSIONS[:-1])
    + f" or {COMPRESSIONS[-1]}, and Parquet plain"
)


def inner_name(path: Path) -> str:
    """A data file's name, lower-cased, without its compression suffix (``a.JSONL.zst`` -> ``a.jsonl``)."""
    name = path.name.lower()
    return next((name[: -len(c)] for c in COMPRESSIONS if name.endswith(c)), name)


def foreign_compression(path: Path) -> str | None:
    """The suffix of a data file compressed or archived in a way cembed does not read
    (``part-1.jsonl.lz4`` -> ``.lz4``, :data:`FOREIGN_COMPRESSIONS`; a Parquet file compressed whole,
    ``part-1.parquet.gz`` -> ``.gz``); None for any other file."""
    name = path.name.lower()
    suffix = next((c for c in FOREIGN_COMPRESSIONS if name.endswith(c)), None)
    if suffix is not None and name[: -len(suffix)].endswith((*TEXT_FORMATS, ".parquet")):
        return suffix
    return next((c for c in COMPRESSIONS if name.endswith(".parquet" + c)), None)


def unreadable_compression(path: Path) -> str:
    """The one-line refusal of a file :func:`foreign_compression` names."""
    return (
        f"{display_path(path)}: a {foreign_compression(path)} file: {READABLE}; decompress it, or compress it "
        "with one of those"
    )


def check_codec(path: Path) -> None:
    """Refuse a file whose compression needs a package that is not installed (``.zst``: zstandard,
    an optional dependency), in one line naming the file and the package.

    Raises:
        UserError: a ``.zst`` file without the zstandard package.
    """
    if path.name.lower().endswith(".zst"):
        _zstandard(path)


def _zstandard(path: Path):
    try:
        import zstandard
    except ImportError:
        raise UserError(
            f"{display_path(path)}: a Zstandard-compressed file needs the zstandard package: pip install zstandard "
            "(or pip install 'cembed[zstd]')"
        ) from None
    return zstandard


def open_binary(path: Path):
    """``path`` opened for reading bytes (line by line), decompressed by its suffix: ``.gz`` gzip,
    ``.bz2`` bzip2, ``.xz`` xz, ``.zst`` Zstandard (the zstandard package); else as it is.

    Raises:
        UserError: a ``.zst`` file without the zstandard package (:func:`check_codec`).
    """
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".bz2"):
        return bz2.open(path, "rb")
    if name.endswith(".xz"):
        return lzma.open(path, "rb")
    if name.endswith(".zst"):
        reader = _zstandard(path).ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.BufferedReader(reader)
    return open(path, "rb")  # the caller closes it


def _decompression_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (gzip.BadGzipFile, EOFError, zlib.error, lzma.LZMAError, OSError)
    try:
        import zstandard

        return (*errors, zstandard.ZstdError)
    except ImportError:
        return errors


def delimiter_of(path: Path) -> tuple[str, int] | None:
    """``(delimiter, csv quoting)`` of a CSV or TSV file, by extension; None for other files. A TSV
    cell is exactly its bytes between tabs: no quote processing (``csv.QUOTE_NONE``)."""
    name = inner_name(path)
    if name.endswith(".csv"):
        return ",", csv.QUOTE_MINIMAL
    if name.endswith(".tsv"):
        return "\t", csv.QUOTE_NONE
    return None


def datasets_string_features(names: list[str]):
    """``datasets.Features`` of text columns named ``names``."""
    import datasets

    return datasets.Features({name: datasets.Value("string") for name in names})


def csv_header(path: Path, delimiter: str, quoting: int) -> list[str] | None:
    """The header row of a CSV/TSV file (None: unreadable; :func:`diagnose_file` says why)."""
    try:
        return next(csv.reader((t for _, t in text_lines(path)), delimiter=delimiter, quoting=quoting), None)
    except (ValueError, csv.Error):
        return None


def csv_records(path: Path, delimiter: str, quoting: int):
    """Yield ``(first line, last line, fields)`` of each record of a CSV/TSV file, header included,
    blank lines skipped (as the reader skips them); ValueError naming the line for bad bytes, a
    quote never closed, or a line break inside a TSV cell."""
    reader = csv.reader((t for _, t in text_lines(path)), delimiter=delimiter, quoting=quoting, strict=True)
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


def read_jsonl_rows(*paths: Path):
    """JSON Lines files (one, or a source's shards in order) read with the standard library (they
    parsed in :func:`diagnose_file`) as a
    ``datasets.Dataset``: a column of text (or null) cells is a string column; any other column is
    kept as JSON text in pyarrow's ``json`` type, as ``datasets`` does for mixed columns, so the cell
    checks can name its non-text cells."""
    import datasets
    import pyarrow as pa

    rows = [json.loads(text) for path in paths for _, text in text_lines(path) if text.strip()]
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


def text_lines(path: Path):
    """Yield ``(line_number, text)`` of a text file, decompressed by its suffix (:func:`open_binary`);
    raises ValueError naming the line for bad bytes of the compression or UTF-8. A UTF-8 byte order
    mark opening the file (Excel's "CSV UTF-8", Notepad) is not text: it is left out of line 1, as
    ``datasets``' readers leave it out. Lines keep their ending (``\n`` or ``\r\n``).

    Raises:
        UserError: a ``.zst`` file without the zstandard package.
    """
    compression = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "Zstandard"}
    kind = next((v for k, v in compression.items() if path.name.lower().endswith(k)), None)
    try:
        with open_binary(path) as f:
            for number, raw in enumerate(f, start=1):
                try:
                    yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(
                        f"line {number}: bytes that are not UTF-8 at column {err.start + 1}; re-encode the file as UTF-8"
                    ) from None
    except PermissionError:
        raise ValueError("cannot read the file: permission denied") from None
    except _decompression_errors() as err:
        if kind is None:
            raise
        raise ValueError(f"corrupt or truncated {kind} ({err.__class__.__name__}: {err}); re-create the file") from None
