"""Training data: load the source (:mod:`cembed.data.sources.registry`), map its columns to roles, check every cell.

The output is a :class:`TrainingData` whose ``dataset`` has exactly the columns the loss embeds, in
order: ``anchor``, ``positive``, then ``negative_1`` ... ``negative_k``. Nothing unnamed survives,
so nothing unnamed is embedded.

Several sources may map different numbers of negatives (triplets beside pairs): the dataset then has
the widest source's columns and a source's rows hold nulls in the columns it does not map. Every
batch holds one source's rows (:mod:`cembed.data.batching.mixture`), so a batch carries only its source's
columns: the collators leave the null columns out and the loss embeds the columns that come.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cembed.config.columns import ColumnMap
from cembed.config.data import DataConfig, TrainSource
from cembed.data.column_mapping import expand_list_columns, unmapped_column_notes
from cembed.data.identity import arrow_table
from cembed.data.rows import LoadedSource, TrainingData, role_columns
from cembed.data.sources.registry import count_files, load_source, read_head, row_locator, skipped_files
from cembed.errors import UserError

# A text cell over 1 MB is a data error (a whole file pasted into a cell), not a sentence.
MAX_TEXT_BYTES = 1_000_000


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
            :func:`cembed.data.sources.registry.row_locator`); default ``row N``.

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


def own_prompt_roles(item: TrainSource) -> tuple[str, ...]:
    """The roles a source's own prompts set (``data.train[.<name>].prompts``; the others are data.prompts')."""
    own = getattr(item.source, "prompts", None) if item.own_prompts else None
    return tuple(role for role in type(own).model_fields if getattr(own, role) is not None) if own else ()


def load_training_source(item: TrainSource, drop_invalid: bool) -> tuple[object, LoadedSource, list[str]]:
    """Load one training source, keep its first ``max_samples`` rows, expand list-valued negatives
    columns (:func:`cembed.data.column_mapping.expand_list_columns`), map its columns to roles and check every cell.

    Returns:
        ``(dataset, LoadedSource with offset 0, notes)``: the notes name unmapped columns
        (:func:`cembed.data.column_mapping.unmapped_column_notes`) and expanded list columns.

    Raises:
        UserError: see :func:`cembed.data.sources.registry.load_source`, :func:`map_columns`, :func:`check_cells`;
            also a source with no rows, or none left after dropping invalid rows.
    """
    source = item.source
    streaming = source.stream_options()
    if streaming is not None:  # only the first rows are checked; training reads the stream
        raw = read_head(source, streaming.check_rows)
    else:
        raw = load_source(source)
    label = source.label if item.key == "data.train" else f"{item.key} ({source.label})"
    if len(raw) == 0:
        raise UserError(f"{label}: the data has no rows")
    # Token ids: the kind's loader hands the manifest over (cembed.data.sources.prepared.load_prepared).
    manifest = raw.cembed_manifest if source.is_pretokenized else None
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
        # No file count: validate's "(N files)" would read as the folder's parts. Its own prompts are
        # kept: the stored ids are checked against them (cembed.data.tokens.model_check).
        prompts = item.prompts if item.own_prompts else None
        info = LoadedSource(
            item.name, source.label, item.key, rows_read, dropped, len(raw), 0, roles, prompts, manifest=manifest
        )
        info.own_prompt_roles = own_prompt_roles(item)
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
    files = count_files(source)
    info = LoadedSource(item.name, source.label, item.key, rows_read, dropped, len(dataset), 0, roles, prompts, files)
    info.skipped = skipped_files(source)
    info.own_prompt_roles = own_prompt_roles(item)
    info.stream = item if streaming is not None else None
    return dataset, info, notes + expanded


def load_training_data(cfg: DataConfig) -> TrainingData:
    """Prepare every source of ``cfg.train`` (:func:`load_training_source`); several sources are
    concatenated in config order (:attr:`TrainingData.sources` says which rows are whose).

    Sources may map different numbers of negatives: a source's rows hold nulls in the columns of
    the wider sources' layout that it does not map (every batch is one source, and carries only its
    source's columns).

    Raises:
        UserError: see :func:`load_training_source`.
    """
    parts = [load_training_source(item, cfg.drop_invalid_rows) for item in cfg.sources()]
    datasets_, infos = [p[0] for p in parts], [p[1] for p in parts]
    warnings = tuple(note for p in parts for note in p[2])
    if len(parts) == 1:
        info = infos[0]
        return TrainingData(datasets_[0], info.where, info.rows_read, info.rows_dropped, info.roles, infos, warnings)
    import datasets

    widest = max((d.column_names for d in datasets_), key=len)  # anchor, positive, negative_1..k: nested layouts
    datasets_ = [_widened(d, widest) for d in datasets_]
    offset = 0
    for info in infos:
        info.offset, offset = offset, offset + info.rows
    roles = {role: " | ".join(dict.fromkeys(i.roles[role] for i in infos if role in i.roles)) for role in widest}
    return TrainingData(
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
