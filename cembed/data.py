"""Training data: load a file or hub dataset, map its columns to roles, check every cell.

The output is a :class:`PreparedData` whose ``dataset`` has exactly the columns the loss embeds, in
order: ``anchor``, ``positive``, then ``negative_1`` ... ``negative_k``. Nothing unnamed survives,
so nothing unnamed is embedded.
"""

from __future__ import annotations

import csv
import gzip
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from cembed.config import ColumnMap, DataConfig, DataSource
from cembed.errors import UserError
from cembed.model import load_model, quiet_libraries

# A text cell over 1 MB is a data error (a whole file pasted into a cell), not a sentence.
MAX_TEXT_BYTES = 1_000_000


@dataclass
class PreparedData:
    """A checked dataset plus what the run summary reports about it."""

    dataset: object  # datasets.Dataset with columns anchor, positive, negative_1..k
    source: str
    rows_read: int
    rows_dropped: int = 0
    roles: dict[str, str] = field(default_factory=dict)  # role column -> source column

    @property
    def columns(self) -> list[str]:
        return list(self.dataset.column_names)


def arrow_table(dataset) -> pa.Table:
    """The dataset's rows as a pyarrow Table (selections applied), without copying when possible."""
    return dataset.with_format("arrow")[:]


def _builder_for(path: Path) -> tuple[str, dict]:
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".json")):
        return "json", {}
    if name.endswith(".csv"):
        return "csv", {}
    if name.endswith(".tsv"):
        return "csv", {"delimiter": "\t"}
    if name.endswith(".parquet"):
        return "parquet", {}
    raise UserError(f"{path}: unsupported file type; use .jsonl[.gz], .json, .csv, .tsv or .parquet")


def load_source(source: DataSource):
    """Load a local file or a hub dataset as a ``datasets.Dataset``.

    Raises:
        UserError: missing file, unsupported extension, unreadable/corrupt content, or a hub dataset
            that cannot be reached.
    """
    import datasets

    datasets.disable_progress_bars()
    if source.is_local:
        path = Path(source.path)
        if not path.exists():
            raise UserError(f"{path}: data file not found (data paths resolve relative to the config file)")
        if path.is_dir():
            raise UserError(f"{path}: is a folder; data.train must name a file")
        if path.stat().st_size == 0:
            raise UserError(f"{path}: data file is empty")
        builder, kwargs = _builder_for(path)
        if builder == "csv":
            # pandas fills short rows with NaN silently; a ragged row must be named instead.
            problem = diagnose_file(path)
            if problem:
                raise UserError(f"{path}: {problem}")
        try:
            dataset = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
            # The JSON reader can pass invalid UTF-8 through into string columns; catch it here.
            dataset.data.table.validate(full=True)
            return dataset
        except Exception as err:  # datasets wraps parser errors in many types
            problem = diagnose_file(path)
            if problem is None:
                first = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
                problem = f"cannot read as {builder}: {first[:300]}"
            raise UserError(f"{path}: {problem}") from None
    try:
        return datasets.load_dataset(source.path, source.subset, split=source.split)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
        raise UserError(
            f"data: cannot load hub dataset {source.path!r} (subset={source.subset}, split={source.split}): "
            f"{first[:300]}"
        ) from None


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
        if name.endswith((".csv", ".tsv")):
            delimiter = "\t" if name.endswith(".tsv") else ","
            text_lines = (t for _, t in _text_lines(path))
            reader = csv.reader(text_lines, delimiter=delimiter)
            header = next(reader, None)
            if not header:
                return "the file has no header row"
            for row in reader:
                if row and len(row) != len(header):
                    return (
                        f"line {reader.line_num}: {len(row)} fields, but the header has {len(header)} "
                        f"({', '.join(header)}); quote fields that contain the delimiter"
                    )
            if reader.line_num <= 1:
                return "the file holds a header but no rows"
            return None
    except ValueError as err:
        return str(err)
    except csv.Error as err:
        return f"malformed CSV: {err}"
    return None


def role_columns(columns: ColumnMap) -> list[tuple[str, str]]:
    """``(source column, role column)`` pairs in loss order: anchor, positive, negative_1..k."""
    pairs = [(columns.anchor, "anchor"), (columns.positive, "positive")]
    pairs += [(src, f"negative_{i + 1}") for i, src in enumerate(columns.negatives)]
    return pairs


def map_columns(dataset, columns: ColumnMap, source: str):
    """Keep only the mapped columns, renamed to their roles, in loss order.

    Raises:
        UserError: a mapped column is missing (the message lists the columns that exist), or one
            source column is mapped to two roles.
    """
    pairs = role_columns(columns)
    config_key = {"anchor": "anchor", "positive": "positive"}
    for src, role in pairs:
        if src not in dataset.column_names:
            key = f"data.columns.{config_key.get(role, 'negatives')}"
            raise UserError(
                f"{source}: column {src!r} ({key}) not found; the data has columns: {', '.join(dataset.column_names)}"
            )
    sources = [src for src, _ in pairs]
    if len(set(sources)) != len(sources):
        dup = next(s for s in sources if sources.count(s) > 1)
        raise UserError(f"data.columns: column {dup!r} is mapped to two roles; each role needs its own column")
    dataset = dataset.select_columns(sources)
    # Rename through temporary names so swapped names (anchor<->positive) cannot collide.
    dataset = dataset.rename_columns({src: f"__cembed_{i}" for i, (src, _) in enumerate(pairs)})
    return dataset.rename_columns({f"__cembed_{i}": role for i, (_, role) in enumerate(pairs)})


def check_cells(dataset, source: str, roles: dict[str, str], drop_invalid: bool):
    """Refuse (or drop, with ``drop_invalid``) rows with a null, empty, blank or over-1-MB cell.

    Returns:
        ``(dataset, rows_dropped)``.

    Raises:
        UserError: naming the column (role and source name) and the 1-based row of the first bad
            cell, or a column whose type is not text at all.
    """
    table = arrow_table(dataset)
    bad = None
    first_bad: tuple[int, str, str] | None = None
    for role in dataset.column_names:
        arr = table.column(role)
        src = roles.get(role, role)
        if arr.type == pa.null():
            reason_col = "only empty values"
            raise UserError(f"{source}: column {src!r} (role {role}) holds {reason_col}; it must hold text")
        if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
            raise UserError(
                f"{source}: column {src!r} (role {role}) holds {arr.type} values; it must hold text "
                "(map a text column in data.columns)"
            )
        null = pc.is_null(arr)
        blank = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(arr), ""), False)
        too_long = pc.fill_null(pc.greater(pc.binary_length(arr), MAX_TEXT_BYTES), False)
        col_bad = pc.or_(pc.or_(null, blank), too_long)
        if pc.any(col_bad).as_py():
            idx = pc.index(col_bad, True).as_py()
            if null[idx].as_py():
                kind = "empty (null/NaN)"
            elif too_long[idx].as_py():
                kind = f"longer than 1 MB ({pc.binary_length(arr)[idx].as_py()} bytes)"
            else:
                kind = "empty or whitespace-only"
            if first_bad is None or idx < first_bad[0]:
                first_bad = (idx, f"column {src!r} (role {role})", kind)
        bad = col_bad if bad is None else pc.or_(bad, col_bad)
    if first_bad is None:
        return dataset, 0
    if not drop_invalid:
        idx, col, kind = first_bad
        raise UserError(
            f"{source}: row {idx + 1}: {col} is {kind}; fix the data or set data.drop_invalid_rows: true to skip such rows"
        )
    keep = pc.invert(bad).to_numpy(zero_copy_only=False).nonzero()[0]
    return dataset.select(keep).flatten_indices(), len(dataset) - len(keep)


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Load ``cfg.train``, keep its first ``cfg.max_samples`` rows, map ``cfg.columns`` to roles and
    check every cell (dropping bad rows with ``cfg.drop_invalid_rows``).

    Raises:
        UserError: see :func:`load_source`, :func:`map_columns`, :func:`check_cells`; also a file
            with no rows.
    """
    source, columns = cfg.train, cfg.columns
    raw = load_source(source)
    label = source.path
    if len(raw) == 0:
        raise UserError(f"{label}: the data has no rows")
    if cfg.max_samples is not None and cfg.max_samples < len(raw):
        raw = raw.select(range(cfg.max_samples))
    rows_read = len(raw)
    roles = {role: src for src, role in role_columns(columns)}
    dataset = map_columns(raw, columns, label)
    dataset, dropped = check_cells(dataset, label, roles, cfg.drop_invalid_rows)
    if len(dataset) == 0:
        raise UserError(f"{label}: every row was invalid and dropped; nothing is left to train on")
    return PreparedData(dataset=dataset, source=label, rows_read=rows_read, rows_dropped=dropped, roles=roles)


def check_batchable(data: PreparedData, global_batch_size: int, no_duplicates: bool) -> None:
    """Refuse data that cannot fill one (duplicate-free) batch of ``global_batch_size`` rows.

    Raises:
        UserError: fewer rows than the batch, or (with ``no_duplicates``) a column with fewer distinct
            texts than the batch, naming the column and its distinct count.
    """
    n = len(data.dataset)
    if n < global_batch_size:
        raise UserError(
            f"{data.source}: {n} rows is fewer than one batch of {global_batch_size} "
            "(batch.per_device_train_batch_size x world size); lower the batch size or add data"
        )
    if not no_duplicates:
        return
    table = arrow_table(data.dataset)
    for role in data.columns:
        distinct = pc.count_distinct(table.column(role)).as_py()
        if distinct < global_batch_size:
            raise UserError(
                f"{data.source}: column {data.roles.get(role, role)!r} (role {role}) has only {distinct} distinct "
                f"texts, so no duplicate-free batch of {global_batch_size} rows exists; lower "
                f"batch.per_device_train_batch_size to at most {distinct} or set sampler.no_duplicates: false"
            )


# --- truncation report -----------------------------------------------------------------------


@dataclass
class ColumnTruncation:
    """How many rows of one column are longer than ``max_seq_length`` tokens (they get cut)."""

    column: str  # role column (anchor, positive, negative_1, ...)
    source: str  # the data's column name
    rows: int  # rows checked
    truncated: int  # rows with more than max_seq_length tokens
    max_tokens: int  # longest row, tokens (special tokens included)

    @property
    def fraction(self) -> float:
        return self.truncated / self.rows if self.rows else 0.0


def truncation_report(
    dataset, tokenizer, max_seq_length: int, roles: dict[str, str] | None = None, sample_rows: int = 20000
) -> list[ColumnTruncation]:
    """Per column, the rows whose token count (special tokens included, as the model tokenizes)
    exceeds ``max_seq_length``, over the first ``sample_rows`` rows of ``dataset``.

    Args:
        dataset: a ``datasets.Dataset`` of text columns.
        tokenizer: a Hugging Face tokenizer (``model.tokenizer``).
        max_seq_length: tokens kept per text.
        roles: role column -> source column name, for display.
        sample_rows: rows checked (the first ones), to bound the time on big data.
    """
    n = min(len(dataset), sample_rows)
    out = []
    for col in dataset.column_names:
        texts = [str(t) for t in dataset[col][:n]] if n < len(dataset) else [str(t) for t in dataset[col]]
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]]
        over = sum(1 for x in lengths if x > max_seq_length)
        out.append(ColumnTruncation(col, (roles or {}).get(col, col), n, over, max(lengths, default=0)))
    return out


def model_truncation_report(model_cfg, data, sample_rows: int = 20000) -> tuple[int, list[ColumnTruncation]]:
    """Load ``model_cfg``'s tokenizer (the model, on CPU) and report truncation of ``data``
    (a PreparedData). Returns ``(max_seq_length, per-column report)``.

    Raises:
        UserError: the model cannot be loaded.
    """
    quiet_libraries()
    model = load_model(model_cfg, "cpu")
    length = int(model.max_seq_length)
    return length, truncation_report(data.dataset, model.tokenizer, length, data.roles, sample_rows)
