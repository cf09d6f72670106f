"""Can the data fill a batch at all: distinct texts per column against the global batch size."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from cembed.config.data import DataConfig
from cembed.data.identity import arrow_table
from cembed.data.load import CHECK_ROWS, load_training_data
from cembed.data.rows import LoadedSource, TrainingData, UnloadedData
from cembed.errors import HubUnavailable, UserError


def load_checked_data(
    cfg: DataConfig, global_batch_size: int, no_duplicates: bool, allow_unloaded: bool = False
) -> TrainingData | UnloadedData:
    """:func:`load_training_data`, then :func:`check_batchable` for ``global_batch_size`` rows.

    Args:
        allow_unloaded: (``validate``) a hub dataset the hub cannot serve (offline, unreachable)
            gives :class:`UnloadedData` instead of the error.

    Raises:
        UserError: see :func:`load_training_data` and :func:`check_batchable`.
    """
    try:
        data = load_training_data(cfg)
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
    source's), compared as the sampler compares them (:func:`cembed.data.identity.row_hashes`: a
    stored ``<role>_hash``, else the ids without the prompt's tokens), :data:`CHECK_ROWS` rows at a
    time, stopping once ``enough`` are seen (then a number ``>= enough``)."""
    from cembed.data.identity import row_hashes

    seen: set[int] = set()
    ids = table.column(role + "_input_ids")
    for start in range(0, table.num_rows, CHECK_ROWS):
        part = table.slice(start, CHECK_ROWS)
        valid = ids.slice(start, CHECK_ROWS).is_valid().to_numpy(zero_copy_only=False)
        seen.update(np.unique(row_hashes(part, [role])[valid, 0]).tolist())
        if len(seen) >= enough:
            break
    return len(seen)


def check_batchable(data: TrainingData, global_batch_size: int, no_duplicates: bool) -> None:
    """Refuse data that cannot fill one (duplicate-free) batch of ``global_batch_size`` rows; with
    several sources, every source must (a batch holds rows of one source only).

    Raises:
        UserError: a source with fewer rows than the batch, or (with ``no_duplicates``) a column with
            fewer distinct texts than the batch, naming the source, the column and its distinct count.
    """
    table = arrow_table(data.dataset)
    for src in data.sources or [LoadedSource(data.source, data.source, "data.train", 0, 0, len(data.dataset), 0)]:
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
