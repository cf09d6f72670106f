"""Training data: load the source (:mod:`cembed.data.sources`), map its columns to roles, check every cell.

The output is a :class:`PreparedData` whose ``dataset`` has exactly the columns the loss embeds, in
order: ``anchor``, ``positive``, then ``negative_1`` ... ``negative_k``. Nothing unnamed survives,
so nothing unnamed is embedded.

Several sources may map different numbers of negatives (triplets beside pairs): the dataset then has
the widest source's columns and a source's rows hold nulls in the columns it does not map. Every
batch holds one source's rows (:mod:`cembed.data.mixture`), so a batch carries only its source's
columns: the collators leave the null columns out and the loss embeds the columns that come.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from cembed.config.data import ColumnMap, DataConfig, FileSource, TrainSource
from cembed.data.columns import expand_list_columns, unmapped_column_notes
from cembed.data.sources import is_sharded, load_source, row_locator, source_files
from cembed.errors import HubUnavailable, UserError
from cembed.model.load import load_model, pooling_in_effect, quiet_libraries, weight_dtypes

# A text cell over 1 MB is a data error (a whole file pasted into a cell), not a sentence.
MAX_TEXT_BYTES = 1_000_000


@dataclass
class PreparedData:
    """A checked dataset plus what the run summary reports about it."""

    dataset: object  # datasets.Dataset with columns anchor, positive, negative_1..k (the widest source's)
    source: str
    rows_read: int
    rows_dropped: int = 0
    roles: dict[str, str] = field(default_factory=dict)  # role column -> source column
    # One entry per training source, in config order; their rows are consecutive in ``dataset``.
    sources: list[SourceData] = field(default_factory=list)
    warnings: tuple[str, ...] = ()  # unmapped columns, expanded list columns (printed by validate and train)

    @property
    def manifest(self):
        """The :class:`cembed.data.prepared.PreparedManifest` of a prepared source (token ids, no
        text; it trains alone), else None."""
        return self.sources[0].manifest if len(self.sources) == 1 else None

    @property
    def columns(self) -> list[str]:
        """The dataset's role columns: the widest source's layout (see the module docstring); a
        prepared source's manifest columns (its dataset holds ``<role>_input_ids`` ..., no text)."""
        if self.manifest is not None:
            return list(self.manifest.columns)
        return list(self.dataset.column_names)

    def source_columns(self) -> list[list[str]]:
        """Each source's own role columns, in ``dataset`` order (one entry for a single source)."""
        return [[c for c in self.columns if c in s.roles] for s in self.sources] or [self.columns]

    def first_row(self) -> dict[str, str]:
        """The first training row's texts by role column (a prepared source: its manifest's first
        sample row; ``{}`` without rows), for ``validate``."""
        if self.manifest is not None:
            samples = self.manifest.samples
            return {c: str(samples[c][0]) for c in self.columns if samples.get(c)}
        return {k: str(v) for k, v in self.dataset[0].items()} if len(self.dataset) else {}

    def sample_texts(self) -> dict[str, list[str]]:
        """One text of every column (``{column: [text]}``), from the first source that maps it; for
        the checks that run the model once per column (unused parameters). A prepared source: its
        manifest's first sample text of each column."""
        if self.manifest is not None:
            samples = self.manifest.samples
            return {c: [samples[c][0]] for c in self.columns if samples.get(c) and samples[c][0] is not None}
        out: dict[str, list[str]] = {}
        for src, columns in zip(self.sources or [None], self.source_columns()):
            row = self.dataset[src.offset if src is not None else 0]
            out |= {c: [row[c]] for c in columns if c not in out}
        return {c: out[c] for c in self.columns if c in out}

    @property
    def streamed(self):
        """The streamed source's :class:`cembed.config.data.StreamingOptions` (``data.train.streaming``),
        or None: then ``dataset`` holds only its first rows (checked), not what training reads."""
        stream = self.sources[0].stream if len(self.sources) == 1 else None
        return stream.source.streaming if stream is not None else None

    def source_sizes(self) -> list[int]:
        """Rows of each source, in ``dataset`` order (one entry for a single source)."""
        return [s.rows for s in self.sources] or [len(self.dataset)]


@dataclass
class SourceData:
    """One training source's share of :class:`PreparedData`: its rows ``offset .. offset + rows``."""

    name: str  # the source's name (data.train.<name>), a default from its path otherwise
    label: str  # its path or id, for messages
    key: str  # the config field holding it (data.train, data.train.<name>)
    rows_read: int
    rows_dropped: int
    rows: int
    offset: int
    roles: dict[str, str] = field(default_factory=dict)  # role column -> this source's column
    prompts: Any = (
        None  # PromptsConfig: its own prompts over data.prompts (data.train.<name>.prompts); None: data.prompts'
    )
    files: int | None = None  # a sharded file source's file count (None: one file, or not a file source)
    manifest: Any = None  # a prepared source's cembed.data.prepared.PreparedManifest (token ids, no text)
    # A streamed source's TrainSource (data.train.streaming): then the rows above are only its first
    # rows, read to check its columns and cells; training reads the stream (cembed.data.streaming).
    stream: Any = None

    @property
    def where(self) -> str:
        """How messages name the source: its path, after its config field when there are several."""
        return self.label if self.key == "data.train" else f"{self.key} ({self.label})"


@dataclass
class UnloadedData:
    """Training data that ``cembed validate`` could not load because the hub is offline or
    unreachable: rows and columns unchecked; everything else is checked without them."""

    source: str
    reason: str  # e.g. "offline: HF_DATASETS_OFFLINE=1"

    @property
    def message(self) -> str:
        """The warning ``validate`` prints."""
        return f"data: hub dataset {self.source} not loaded ({self.reason}); rows and columns unchecked"


def arrow_table(dataset) -> pa.Table:
    """The dataset's rows as a pyarrow Table (selections applied), without copying when possible."""
    return dataset.with_format("arrow")[:]


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


def _describe(cell: str) -> str:
    """What a non-text JSON cell (its JSON text) holds, for messages: ``a number (42)``, ``a list``."""
    value = json.loads(cell)
    shown = cell if len(cell) <= 40 else cell[:37] + "..."
    if isinstance(value, bool):
        return f"a boolean ({shown})"
    if isinstance(value, (int, float)):
        return f"a number ({shown})"
    return f"{'a list' if isinstance(value, list) else 'an object'} ({shown})"


# Rows per slice the cell checks and distinct counts work on: their temporaries (a trimmed copy of
# a slice's texts, masks) are bounded by a slice, never a whole column.
CHECK_ROWS = 65_536


def _text_cells(arr) -> tuple[pa.ChunkedArray, dict[int, str] | None]:
    """A column of JSON cells (pyarrow's ``json`` type: the reader found text and non-text values)
    as ``(text column with non-text cells null, {row: description} of the non-text cells)``,
    converted :data:`CHECK_ROWS` rows at a time; a text column passes through as ``(arr, None)``."""
    if not (isinstance(arr.type, pa.BaseExtensionType) and pa.types.is_string(arr.type.storage_type)):
        return arr, None
    chunks, kinds = [], {}
    for start in range(0, len(arr), CHECK_ROWS):
        part = arr.slice(start, CHECK_ROWS)
        cells = pa.chunked_array([c.storage for c in part.chunks], arr.type.storage_type).to_pylist()
        texts = []
        for i, cell in enumerate(cells):
            value = None if cell is None else json.loads(cell)
            texts.append(value if isinstance(value, str) else None)
            if value is not None and not isinstance(value, str):
                kinds[start + i] = _describe(cell)
        chunks.append(pa.array(texts, pa.string()))
    return pa.chunked_array(chunks, pa.string()), kinds


def _first_bad_cell(arr, start: int, kinds: dict[int, str] | None, src: str, role: str):
    """``(bad mask, (row, problem) of its first bad cell or None)`` for the slice ``arr`` of a text
    column starting at row ``start``: a null, empty, blank or over-1-MB cell, or a non-text one."""
    null = pc.is_null(arr)
    blank = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(arr), ""), False)
    too_long = pc.fill_null(pc.greater(pc.binary_length(arr), MAX_TEXT_BYTES), False)
    col_bad = pc.or_(pc.or_(null, blank), too_long)
    if not pc.any(col_bad).as_py():
        return col_bad, None
    idx = pc.index(col_bad, True).as_py()
    if kinds is not None and start + idx in kinds:
        problem = f"column {src!r} (role {role}) holds {kinds[start + idx]}; it must hold text"
    elif null[idx].as_py():
        problem = f"column {src!r} (role {role}) is empty (null/NaN)"
    elif too_long[idx].as_py():
        problem = f"column {src!r} (role {role}) is longer than 1 MB ({pc.binary_length(arr)[idx].as_py()} bytes)"
    else:
        problem = f"column {src!r} (role {role}) is empty or whitespace-only"
    return col_bad, (start + idx, problem)


def check_cells(dataset, source: str, roles: dict[str, str], drop_invalid: bool, locate=None):
    """Refuse (or drop, with ``drop_invalid``) rows with a null, empty, blank or over-1-MB cell, or
    a number, boolean, list or object in a text column (a JSON file mixing them with text).

    Checked :data:`CHECK_ROWS` rows at a time with pyarrow compute (no Python object per row but
    for a JSON column mixing text and other values); a refusal stops at the first bad cell.

    Args:
        locate: 0-based row index -> how to name it (``line N`` for JSON Lines, see
            :func:`cembed.data.sources.row_locator`); default ``row N``.

    Returns:
        ``(dataset, rows_dropped)``; a column that held non-text cells comes back as text.

    Raises:
        UserError: naming the row (or line), the column (role and source name) and the first bad
            cell, or a column whose type is not text at all.
    """
    locate = locate or (lambda index: f"row {index + 1}")
    table = arrow_table(dataset)
    n = table.num_rows
    bad = np.zeros(n, dtype=bool) if drop_invalid else None  # rows to drop, 1 B/row only when dropping
    first_bad: tuple[int, str] | None = None
    replaced = {}
    for role in dataset.column_names:
        src = roles.get(role, role)
        arr, kinds = _text_cells(table.column(role))
        if kinds is not None:
            replaced[role] = arr
        if arr.type == pa.null():
            raise UserError(f"{source}: column {src!r} (role {role}) holds only empty values; it must hold text")
        if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
            raise UserError(
                f"{source}: column {src!r} (role {role}) holds {arr.type} values; it must hold text "
                "(map a text column in data.columns)"
            )
        # Without drop_invalid only the first bad row matters: no slice past the one already found.
        end = n if first_bad is None or drop_invalid else first_bad[0] + 1
        for start in range(0, end, CHECK_ROWS):
            col_bad, found = _first_bad_cell(arr.slice(start, CHECK_ROWS), start, kinds, src, role)
            if found is None:
                continue
            if first_bad is None or found[0] < first_bad[0]:
                first_bad = found
            if bad is None:
                break
            bad[start : start + len(col_bad)] |= col_bad.to_numpy(zero_copy_only=False)
    if replaced:
        import datasets

        for role, arr in replaced.items():
            table = table.set_column(table.column_names.index(role), role, arr)
        dataset = datasets.Dataset(datasets.table.InMemoryTable(table))
    if first_bad is None:
        return dataset, 0
    if not drop_invalid:
        idx, problem = first_bad
        raise UserError(
            f"{source}: {locate(idx)}: {problem}; fix the data or set data.drop_invalid_rows: true to skip such rows"
        )
    keep = np.flatnonzero(~bad)
    return dataset.select(keep).flatten_indices(), len(dataset) - len(keep)


def source_views(data: PreparedData) -> list[PreparedData]:
    """Each training source of ``data`` as a PreparedData of its own rows (``data`` itself when it
    has one source), for reports that are per source (inspect-data, rows that cannot be placed)."""
    if len(data.sources) <= 1:
        return [data]
    views = []
    for src, columns in zip(data.sources, data.source_columns()):
        rows = data.dataset.select(range(src.offset, src.offset + src.rows)).select_columns(columns)
        view_src = replace(src, offset=0)
        views.append(PreparedData(rows, src.where, src.rows_read, src.rows_dropped, src.roles, [view_src]))
    return views


def prepared_samples(manifest):
    """A prepared source's sample texts (its manifest's first rows) as a ``datasets.Dataset`` of its
    role columns, the rows every column has a text for."""
    import datasets

    samples = {c: list(manifest.samples.get(c) or []) for c in manifest.columns}
    rows = min(len(v) for v in samples.values())
    return datasets.Dataset.from_dict({c: v[:rows] for c, v in samples.items()})


def card_datasets(data: PreparedData):
    """Each source's rows with its own columns, as a ``DatasetDict`` by source name, for what the
    model card describes, when the sources' columns differ; None otherwise (the dataset itself). A
    prepared source (token ids, no text): a ``Dataset`` of its manifest's sample texts. A streamed
    source: its first rows (the trainer's dataset is the stream)."""
    if data.manifest is not None:
        return prepared_samples(data.manifest)
    if data.streamed is not None:
        return data.dataset
    if len({tuple(c) for c in data.source_columns()}) <= 1:
        return None
    import datasets

    return datasets.DatasetDict({s.name: v.dataset for s, v in zip(data.sources, source_views(data))})


def prepare_source(item: TrainSource, drop_invalid: bool) -> tuple[object, SourceData, list[str]]:
    """Load one training source, keep its first ``max_samples`` rows, expand list-valued negatives
    columns (:func:`cembed.data.columns.expand_list_columns`), map its columns to roles and check every cell.

    Returns:
        ``(dataset, SourceData with offset 0, notes)``: the notes name unmapped columns
        (:func:`cembed.data.columns.unmapped_column_notes`) and expanded list columns.

    Raises:
        UserError: see :func:`cembed.data.sources.load_source`, :func:`map_columns`, :func:`check_cells`;
            also a source with no rows, or none left after dropping invalid rows.
    """
    source = item.source
    streaming = getattr(source, "streaming", None)
    if streaming is not None:  # only the first rows are checked; training reads the stream
        from cembed.data.streaming import read_head

        raw = read_head(source, streaming.check_rows)
    else:
        raw = load_source(source)
    label = source.label if item.key == "data.train" else f"{item.key} ({source.label})"
    if len(raw) == 0:
        raise UserError(f"{label}: the data has no rows")
    manifest = getattr(raw, "cembed_manifest", None)  # a prepared source's (cembed.data.sources.load_prepared)
    if item.max_samples is not None and item.max_samples < len(raw):
        raw = raw.select(range(item.max_samples))
    rows_read = len(raw)
    if manifest is not None:
        # Token ids only: the roles are the manifest's, and the cells were checked when it was prepared.
        roles = {c: c for c in manifest.columns}
        if item.columns_given:  # the mapping the folder was prepared with: it must give the same roles
            mapped = [role for _, role in role_columns(item.columns)]
            if mapped != list(manifest.columns):
                raise UserError(
                    f"data.columns: maps the roles {', '.join(mapped)}, but the prepared source {label} holds "
                    f"{', '.join(manifest.columns)} (its roles were mapped when it was prepared); remove data.columns"
                )
        rows_read = manifest.rows_read if manifest.rows_read is not None and item.max_samples is None else rows_read
        dropped = manifest.rows_dropped if item.max_samples is None else 0
        # No file count: validate's "(N files)" would read as the folder's parts.
        info = SourceData(item.name, source.label, item.key, rows_read, dropped, len(raw), 0, roles, manifest=manifest)
        return raw, info, []
    notes = unmapped_column_notes(raw.column_names, item.columns, item.key, label, source.kind)
    raw, columns, expanded = expand_list_columns(raw, item.columns, label, item.key)
    if streaming is not None and expanded:
        raise UserError(
            f"{item.key}.streaming: a list column of negatives cannot be streamed ({expanded[0]}); "
            "give each negative its own column or drop streaming"
        )
    roles = {role: src for src, role in role_columns(columns)}
    dataset = map_columns(raw, columns, label)
    dataset, dropped = check_cells(dataset, label, roles, drop_invalid, row_locator(source))
    if len(dataset) == 0:
        raise UserError(f"{label}: every row was invalid and dropped; nothing is left to train on")
    prompts = item.prompts if item.own_prompts else None
    files = len(source_files(source)) if isinstance(source, FileSource) and is_sharded(source) else None
    info = SourceData(item.name, source.label, item.key, rows_read, dropped, len(dataset), 0, roles, prompts, files)
    info.stream = item if streaming is not None else None
    return dataset, info, notes + expanded


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Prepare every source of ``cfg.train`` (:func:`prepare_source`); several sources are
    concatenated in config order (:attr:`PreparedData.sources` says which rows are whose).

    Sources may map different numbers of negatives: a source's rows hold nulls in the columns of
    the wider sources' layout that it does not map (every batch is one source, and carries only its
    source's columns).

    Raises:
        UserError: see :func:`prepare_source`.
    """
    parts = [prepare_source(item, cfg.drop_invalid_rows) for item in cfg.sources()]
    datasets_, infos = [p[0] for p in parts], [p[1] for p in parts]
    warnings = tuple(note for p in parts for note in p[2])
    if len(parts) == 1:
        info = infos[0]
        return PreparedData(datasets_[0], info.where, info.rows_read, info.rows_dropped, info.roles, infos, warnings)
    import datasets

    widest = max((d.column_names for d in datasets_), key=len)  # anchor, positive, negative_1..k: nested layouts
    datasets_ = [_widened(d, widest) for d in datasets_]
    offset = 0
    for info in infos:
        info.offset, offset = offset, offset + info.rows
    roles = {role: " | ".join(dict.fromkeys(i.roles[role] for i in infos if role in i.roles)) for role in widest}
    return PreparedData(
        dataset=datasets.concatenate_datasets(datasets_),
        source=" + ".join(i.name for i in infos),
        rows_read=sum(i.rows_read for i in infos),
        rows_dropped=sum(i.rows_dropped for i in infos),
        roles=roles,
        sources=infos,
        warnings=warnings,
    )


def _widened(dataset, columns: list[str]):
    """``dataset`` with a null text column for each of ``columns`` it lacks, in ``columns``' order."""
    import datasets

    missing = [c for c in columns if c not in dataset.column_names]
    for column in missing:
        dataset = dataset.add_column(column, [None] * len(dataset), feature=datasets.Value("string"))
    return dataset.select_columns(columns) if missing else dataset


def prepare_checked_data(
    cfg: DataConfig, global_batch_size: int, no_duplicates: bool, allow_unloaded: bool = False
) -> PreparedData | UnloadedData:
    """:func:`prepare_data`, then :func:`check_batchable` for ``global_batch_size`` rows.

    Args:
        allow_unloaded: (``validate``) a hub dataset the hub cannot serve (offline, unreachable)
            gives :class:`UnloadedData` instead of the error.

    Raises:
        UserError: see :func:`prepare_data` and :func:`check_batchable`.
    """
    try:
        data = prepare_data(cfg)
    except HubUnavailable as err:
        if not allow_unloaded:
            raise
        return UnloadedData(err.dataset_id, err.reason)
    if data.streamed is None:  # a stream's rows are not counted: its batches are what the window rule makes
        check_batchable(data, global_batch_size, no_duplicates)
    return data


def distinct_at_least(column, enough: int) -> int:
    """The number of distinct non-null texts of ``column`` (an arrow string column), counted
    :data:`CHECK_ROWS` rows at a time and stopping once ``enough`` are seen (then a number
    ``>= enough``, not the full count): memory grows with ``enough``, not with the column. Texts are
    compared by their 64-bit xxh64 (a collision, ~n^2 / 2^65, would undercount by one)."""
    seen: set[int] = set()
    for start in range(0, len(column), CHECK_ROWS):
        part = pc.unique(pc.drop_null(column.slice(start, CHECK_ROWS)))
        seen.update(xxhash.xxh64_intdigest(t.encode("utf-8")) for t in part.to_pylist())
        if len(seen) >= enough:
            break
    return len(seen)


def distinct_hashes_at_least(table: pa.Table, role: str, enough: int) -> int:
    """The number of distinct non-null rows of ``role`` in a table of token ids (a prepared
    source's), compared as the sampler compares them (:func:`cembed.data.sampler.row_hashes`: a
    stored ``<role>_hash``, else the ids without the prompt's tokens), :data:`CHECK_ROWS` rows at a
    time, stopping once ``enough`` are seen (then a number ``>= enough``)."""
    from cembed.data.sampler import row_hashes

    seen: set[int] = set()
    ids = table.column(role + "_input_ids")
    for start in range(0, table.num_rows, CHECK_ROWS):
        part = table.slice(start, CHECK_ROWS)
        valid = ids.slice(start, CHECK_ROWS).is_valid().to_numpy(zero_copy_only=False)
        seen.update(np.unique(row_hashes(part, [role])[valid, 0]).tolist())
        if len(seen) >= enough:
            break
    return len(seen)


def check_batchable(data: PreparedData, global_batch_size: int, no_duplicates: bool) -> None:
    """Refuse data that cannot fill one (duplicate-free) batch of ``global_batch_size`` rows; with
    several sources, every source must (a batch holds rows of one source only).

    Raises:
        UserError: a source with fewer rows than the batch, or (with ``no_duplicates``) a column with
            fewer distinct texts than the batch, naming the source, the column and its distinct count.
    """
    table = arrow_table(data.dataset)
    for src in data.sources or [SourceData(data.source, data.source, "data.train", 0, 0, len(data.dataset), 0)]:
        n = src.rows
        if n < global_batch_size:
            raise UserError(
                f"{src.where}: {n} rows is fewer than one batch of {global_batch_size} "
                f"(batch.per_device_train_batch_size x world size); lower batch.per_device_train_batch_size so "
                f"that batch x world size is at most {n}, or add data"
            )
        if not no_duplicates:
            continue
        rows = table.slice(src.offset, n)
        for role in [c for c in data.columns if c in src.roles or not data.sources]:
            if src.manifest is not None:  # token ids, no text: distinct row hashes (what the sampler compares)
                distinct = distinct_hashes_at_least(rows, role, global_batch_size)
            else:
                distinct = distinct_at_least(rows.column(role), global_batch_size)
            if distinct < global_batch_size:
                raise UserError(
                    f"{src.where}: column {src.roles.get(role, data.roles.get(role, role))!r} (role {role}) has only "
                    f"{distinct} distinct texts, so no duplicate-free batch of {global_batch_size} rows exists; lower "
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
    dataset,
    tokenizer,
    max_seq_length: int,
    roles: dict[str, str] | None = None,
    sample_rows: int = 20000,
    prompts: dict[str, str] | None = None,
) -> list[ColumnTruncation]:
    """Per column, the rows whose token count (special tokens included, as the model tokenizes)
    exceeds ``max_seq_length``, over the first ``sample_rows`` rows of ``dataset``.

    Args:
        dataset: a ``datasets.Dataset`` of text columns.
        tokenizer: a Hugging Face tokenizer (``model.tokenizer``).
        max_seq_length: tokens kept per text.
        roles: role column -> source column name, for display.
        sample_rows: rows checked (the first ones), to bound the time on big data.
        prompts: ``{column: prompt}`` prepended as in training (its tokens count toward the length).
    """
    n = min(len(dataset), sample_rows)
    out = []
    for col in dataset.column_names:
        prompt = (prompts or {}).get(col, "")
        cells = dataset[col][:n] if n < len(dataset) else dataset[col]
        texts = [prompt + str(t) for t in cells if t is not None]  # null: a source without this column
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]]
        over = sum(1 for x in lengths if x > max_seq_length)
        out.append(ColumnTruncation(col, (roles or {}).get(col, col), len(texts), over, max(lengths, default=0)))
    return out


def resolve_source_prompts(data: PreparedData, model, run_prompts) -> list | None:
    """Each source's prompts (:class:`cembed.model.prompts.RolePrompts`, in ``data.sources`` order)
    when a source sets its own (``data.train.<name>.prompts``, role by role over ``data.prompts``,
    then the model's own); None when none does (every source trains with ``run_prompts``).

    Raises:
        ModelRefused: a source's ``{name: ...}`` names no prompt of the model (the message names
            ``data.train.<name>.prompts.<role>``).
    """
    from cembed.model.prompts import resolve_prompts

    if not any(s.prompts is not None for s in data.sources):
        return None
    return [
        run_prompts if s.prompts is None else resolve_prompts(s.prompts, model, where=f"{s.key}.prompts")
        for s in data.sources
    ]


class TrainingPrompts(NamedTuple):
    """The prompts training tokenizes with (:func:`training_prompts`).

    Attributes:
        run: the run-wide :class:`cembed.model.prompts.RolePrompts` (``data.prompts``, else the model's).
        per_source: each source's RolePrompts (``data.sources`` order), or None when no source sets its own.
        columns: ``{role column: prompt}`` of ``run`` for ``data.columns``.
        by_source: ``{role column: prompt}`` per source (its own columns), or None.
    """

    run: Any
    per_source: list | None
    columns: dict[str, str]
    by_source: list[dict[str, str]] | None


def training_prompts(data: PreparedData, model, prompts_cfg) -> TrainingPrompts:
    """Resolve the prompts training prepends, run-wide and per source, in one place, so that training
    (``build_components``) and the sampler's duplicate check in ``validate`` tokenize alike.

    Raises:
        ModelRefused: ``data.prompts`` or a source's prompts name no prompt of the model.
    """
    from cembed.model.prompts import resolve_prompts

    run = resolve_prompts(prompts_cfg, model)
    per_source = resolve_source_prompts(data, model, run)
    by_source = None
    if per_source is not None:
        by_source = [p.for_columns(c) for p, c in zip(per_source, data.source_columns())]
    return TrainingPrompts(run, per_source, run.for_columns(data.columns), by_source)


def stored_length_report(dataset, columns: list[str], max_seq_length: int) -> list[ColumnTruncation]:
    """Per role column of a prepared source (token ids, no text), the rows whose stored ids reach
    ``max_seq_length`` (special tokens included: cut, or exactly that long) and the longest row, over
    every row, with pyarrow compute (no Python object per row)."""
    table = arrow_table(dataset)
    out = []
    for col in columns:
        lengths = pc.list_value_length(table.column(col + "_input_ids"))
        rows = len(lengths) - lengths.null_count
        at_limit = pc.sum(pc.greater_equal(lengths, max_seq_length)).as_py() or 0
        out.append(ColumnTruncation(col, col, rows, at_limit, pc.max(lengths).as_py() or 0))
    return out


def _merged_truncation(reports: list[list[ColumnTruncation]]) -> list[ColumnTruncation]:
    """Per-source truncation reports as one per column (rows and truncated rows summed, longest kept)."""
    merged: dict[str, ColumnTruncation] = {}
    for report in reports:
        for c in report:
            m = merged.get(c.column)
            merged[c.column] = (
                c
                if m is None
                else ColumnTruncation(
                    c.column, m.source, m.rows + c.rows, m.truncated + c.truncated, max(m.max_tokens, c.max_tokens)
                )
            )
    return list(merged.values())


class ModelTruncation(NamedTuple):
    """:func:`model_truncation_report`'s answer: the length, the per-column report, the pooling in
    effect (:func:`cembed.model.load.pooling_in_effect`) and the weights' dtypes (:func:`cembed.model.load.weight_dtypes`)."""

    max_seq_length: int
    columns: list[ColumnTruncation]
    pooling: str
    weights: Any = None  # cembed.model.load.WeightDtypes: stored, training, autocast and saved dtypes
    prompts: Any = None  # cembed.model.prompts.RolePrompts: each role's prompt
    attention: Any = None  # cembed.model.unpad.Unpadding: packed rows or padded mini-batches (batch.unpad)
    source_prompts: Any = None  # {source name: RolePrompts} when a source sets prompts of its own, else None
    stored_ids: bool = False  # a prepared source: ``columns`` count rows whose stored ids reach max_seq_length


def model_truncation_report(
    model_cfg,
    data,
    sample_rows: int = 20000,
    prompts_cfg=None,
    unpad="auto",
    precision: str | None = None,
    model=None,
) -> ModelTruncation:
    """Load ``model_cfg``'s model (on CPU) and report truncation of ``data`` (a PreparedData), with
    the pooling the model uses, its stored / training / saved dtypes, each role's prompt
    (``prompts_cfg``, the ``data.prompts`` section, resolved against the model; a source's own
    ``prompts`` for its rows, :func:`resolve_source_prompts`; prompt tokens count toward the length)
    and the attention path ``unpad`` (``batch.unpad``) gives it; the per-column
    report is empty for :class:`UnloadedData` (only the model is checked). ``precision`` is the run's
    resolved precision for the dtypes' autocast (``Plan.precision``; None: ``model_cfg.precision``
    resolved on CPU, where the model is loaded). ``model``: the model already loaded on CPU from
    ``model_cfg`` (None: loaded here).

    Raises:
        UserError: the model cannot be loaded; ModelRefused (a UserError) when cembed refuses it,
            ``data.prompts`` names a prompt it lacks, or ``unpad`` is True and it cannot run packed rows.
    """
    from cembed.model.prompts import resolve_prompts
    from cembed.model.unpad import resolve_unpad

    if model is None:
        quiet_libraries()
        model = load_model(model_cfg, "cpu")
    length = int(model.max_seq_length)
    pooling = pooling_in_effect(model, model_cfg)
    weights = weight_dtypes(model, model_cfg, precision)
    prompts = resolve_prompts(prompts_cfg, model)
    attention = resolve_unpad(model, unpad)
    if isinstance(data, UnloadedData):  # the model loads; there are no rows to measure
        return ModelTruncation(length, [], pooling, weights, prompts, attention)
    if data.manifest is not None:  # token ids, no text: rows whose ids reach the length (maybe cut)
        from cembed.data.from_prepared import check_prepared_for_model
        from cembed.files import display_path

        # The refusals training gives (tokenizer, max_seq_length, prompts), also without the sampler's check.
        where = display_path(data.sources[0].label)
        check_prepared_for_model(model, data.manifest, where, prompts.for_columns(data.columns))
        report = stored_length_report(data.dataset, data.columns, length)
        return ModelTruncation(length, report, pooling, weights, prompts, attention, None, True)
    per_source = resolve_source_prompts(data, model, prompts)
    if per_source is None:
        by_column = prompts.for_columns(data.columns)
        report = truncation_report(data.dataset, model.tokenizer, length, data.roles, sample_rows, by_column)
    else:  # each source's rows with its own prompts
        views = source_views(data)
        report = _merged_truncation(
            [
                truncation_report(v.dataset, model.tokenizer, length, data.roles, sample_rows, p.for_columns(v.columns))
                for v, p in zip(views, per_source)
            ]
        )
    by_source = None if per_source is None else {s.name: p for s, p in zip(data.sources, per_source)}
    return ModelTruncation(length, report, pooling, weights, prompts, attention, by_source)
