"""What makes two rows the same: the columns a row is stored and compared by, and its 64-bit hashes.

The identity contract every stage shares. A role's token ids sit in ``<role>_input_ids``
(:data:`TOKEN_SUFFIX`), its prompt's token count in ``<role>_prompt_length`` (:data:`PROMPT_SUFFIX`)
and the hash of the ids without the prompt in ``<role>_hash`` (:data:`HASH_SUFFIX`). Tokenize-once
writes those columns (:mod:`cembed.data.tokens`), the samplers (:mod:`cembed.data.batching`) and the
distinct-row checks read them, and a prepared folder stores them: all of them hash a text the same
way (:func:`hash_texts`, :func:`hash_token_ids`, :func:`row_hashes`), so a duplicate found by one is a
duplicate for all.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import xxhash

# Rows per record batch the hashes are computed over (bounds the temporaries, not the result).
_SLICE_ROWS = 65_536
# Tokens per slice of a token-id column: a slice's per-token temporaries are a few uint64 arrays this long.
_SLICE_TOKENS = 1 << 20
_MIX1, _MIX2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, in place on a uint64 array (a bijection of uint64: distinct in, distinct out)."""
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _MIX1
        x ^= x >> np.uint64(27)
        x *= _MIX2
        x ^= x >> np.uint64(31)
    return x


def hash_texts(texts) -> np.ndarray:
    """xxh64 of each UTF-8 text (a null: of ``""``), shape ``(len(texts),)``, dtype uint64.

    ``texts``: a list of str, or an arrow string array / chunked array, hashed ``_SLICE_ROWS`` rows
    at a time (only one slice's Python strings exist at once)."""
    h = xxhash.xxh64_intdigest
    if isinstance(texts, list):
        return np.fromiter(
            (h(("" if t is None else str(t)).encode("utf-8")) for t in texts), dtype=np.uint64, count=len(texts)
        )
    out = np.empty(len(texts), dtype=np.uint64)
    for start in range(0, len(texts), _SLICE_ROWS):
        part = texts.slice(start, _SLICE_ROWS).to_pylist()
        out[start : start + len(part)] = hash_texts(part)
    return out


def hash_token_ids(column, skip: int | np.ndarray = 0) -> np.ndarray:
    """A 64-bit hash of each row's token ids (an arrow list column, chunked or not) after the first
    ``skip`` (a prompt's tokens; one count for every row, or one per row), shape ``(rows,)`` uint64.
    Equal id sequences hash equal; a null row hashes as an empty one.

    Vectorised, without a Python step per row or a copy of the column: each chunk's offsets and
    values are numpy views, taken ``_SLICE_TOKENS`` tokens at a time. Token ``t`` at position ``p``
    (counted after the skip) becomes ``mix(t * 2^32 + p + golden)`` (``mix``: splitmix64's
    finalizer, a bijection, so distinct (token, position) pairs give distinct words); a row's hash
    is ``mix(sum of its words + mix(length))`` mod 2^64. Collisions: two different sequences
    differ in at least one (token, position) pair, each pair occurs at most once per row, so the
    difference of their sums is a +-1 combination of distinct mixed words, which behaves as a
    uniform 64-bit value: a pair of different rows collides with probability ~2^-64 (1e8 texts:
    ~3e-4 expected colliding pairs, and a collision only defers a row). Position is part of the key:
    the same tokens in another order hash differently. Token ids and positions must be < 2^32."""
    chunks = column.chunks if hasattr(column, "chunks") else [column]
    n = sum(len(c) for c in chunks)
    skip_all = np.broadcast_to(np.asarray(skip, dtype=np.int64), (n,))
    out = np.empty(n, dtype=np.uint64)
    done = 0
    for chunk in chunks:
        if len(chunk) == 0:
            continue
        offsets = chunk.offsets.to_numpy().astype(np.int64, copy=False)  # absolute into chunk.values
        values = chunk.values.to_numpy(zero_copy_only=False)
        row = 0
        while row < len(chunk):
            # As many rows as fit in the token budget (at least one).
            end = int(np.searchsorted(offsets, offsets[row] + _SLICE_TOKENS, side="right")) - 1
            end = min(max(end, row + 1), len(chunk))
            off = offsets[row : end + 1]
            lo, hi = int(off[0]), int(off[-1])
            lengths = np.diff(off)
            starts = np.minimum(off[:-1] + skip_all[done + row : done + end], off[1:])
            token_row = np.repeat(np.arange(end - row), lengths)
            pos = np.arange(lo, hi, dtype=np.int64) - starts[token_row]  # < 0: a prompt token
            words = values[lo:hi].astype(np.uint64) << np.uint64(32)
            words += pos.astype(np.uint64)
            words += _GOLDEN
            _mix64(words)
            words[pos < 0] = 0
            sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(words, dtype=np.uint64)])
            with np.errstate(over="ignore"):
                rel = off - lo
                total = sums[rel[1:]] - sums[rel[:-1]]
                total += _mix64((off[1:] - starts).astype(np.uint64))
            out[done + row : done + end] = _mix64(total)
            row = end
        done += len(chunk)
    return out


def row_hashes(dataset, columns: list[str] | None = None) -> np.ndarray:
    """Hash each of ``columns`` (None: every column but ``dataset_name``; ``[]``: none, shape
    ``(rows, 0)``): shape ``(rows, columns)`` uint64. ``dataset``: a ``datasets.Dataset`` or a
    ``pyarrow.Table``. A column with a stored ``<column>_hash`` (uint64, made when the ids were
    tokenized: a prepared source's, :mod:`cembed.data.tokens.format`) is that hash; else a column
    pre-tokenized as ``<column>_input_ids`` is hashed by its token ids, the text as the model sees
    it (casing and spacing an uncased tokenizer removes, truncation), without its prompt's tokens (a
    ``<column>_prompt_length`` column, per row: one text is one text whichever prompt it carries),
    else by its text. The text column itself may be absent (a prepared source holds ids only). A
    null cell (a source that does not map the column, see :func:`cembed.data.load.load_training_data`;
    a null ids cell or stored hash) is no text: it takes the row's first column's hash, and a text
    repeated inside one row never collides."""
    # The rows as an Arrow table, selections applied (cembed.data.identity.arrow_table, not imported:
    # prepare counts distinct rows with this function).
    table = dataset if isinstance(dataset, pa.Table) else dataset.with_format("arrow")[:]
    names = set(table.column_names)
    if columns is None:
        columns = [c for c in table.column_names if c != "dataset_name"]
    out = np.empty((table.num_rows, len(columns)), dtype=np.uint64)
    null = np.zeros((table.num_rows, len(columns)), dtype=bool)
    for j, col in enumerate(columns):
        cell = table.column(col) if col in names else table.column(col + TOKEN_SUFFIX)
        null[:, j] = cell.is_null().to_numpy(zero_copy_only=False)
        if col + HASH_SUFFIX in names:
            stored = table.column(col + HASH_SUFFIX)
            null[:, j] |= stored.is_null().to_numpy(zero_copy_only=False)
            out[:, j] = np.asarray(stored.fill_null(0).to_numpy(), dtype=np.uint64)
        elif col + TOKEN_SUFFIX in names:
            skip = 0
            if col + PROMPT_SUFFIX in names:
                lengths = table.column(col + PROMPT_SUFFIX).fill_null(0)
                skip = np.asarray(lengths.to_numpy(), dtype=np.int64)
            out[:, j] = hash_token_ids(table.column(col + TOKEN_SUFFIX), skip)
        else:
            out[:, j] = hash_texts(table.column(col))
    if null.any() and len(columns):
        rows, cols = np.nonzero(null)
        out[rows, cols] = out[rows, 0]  # the anchor: every source maps it
    return out


def compared_columns(dataset, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The role columns the sampler compares, in ``dataset`` order: its text columns, and each
    ``<role>_input_ids`` column without a ``<role>`` text column (a prepared source holds ids only);
    not ``exclude`` (label columns)."""
    names = dataset.column_names
    out = []
    for c in names:
        if c in exclude:
            continue
        if getattr(dataset.features[c], "dtype", None) in ("string", "large_string"):
            out.append(c)
        elif c.endswith(TOKEN_SUFFIX) and c.removesuffix(TOKEN_SUFFIX) not in names:
            out.append(c.removesuffix(TOKEN_SUFFIX))
    return out


TOKEN_SUFFIX = "_input_ids"
PROMPT_SUFFIX = "_prompt_length"  # a constant int column next to a prompted role's ids
HASH_SUFFIX = "_hash"


def arrow_table(dataset) -> pa.Table:
    """The dataset's rows as a pyarrow Table (selections applied), without copying when possible."""
    return dataset.with_format("arrow")[:]


def rows_digest(dataset, start: int = 0, stop: int | None = None) -> str:
    """A 128-bit hash (xxh3, 32 hex characters) of rows ``start .. stop`` of a ``datasets.Dataset``
    (or a ``pyarrow.Table``) by value: the column names, then each column's per-row hashes in row
    order (text: :func:`hash_texts`; token ids: :func:`hash_token_ids`; fixed-width numbers: their
    bytes; anything else: its JSON). Equal rows give equal digests however the table is chunked or
    stored (memory-mapped, in memory, behind a selection); a changed cell, row or order changes it.
    Read ``_SLICE_ROWS`` rows at a time: the whole table is read once, nothing is kept."""
    table = dataset if isinstance(dataset, pa.Table) else None
    rows = table.num_rows if table is not None else len(dataset)
    stop = rows if stop is None else min(stop, rows)
    h = xxhash.xxh3_128()
    names = table.column_names if table is not None else dataset.column_names
    h.update(json.dumps(list(names)).encode("utf-8"))
    arrow = dataset.with_format("arrow") if table is None else None
    for begin in range(start, stop, _SLICE_ROWS):
        end = min(stop, begin + _SLICE_ROWS)
        part = table.slice(begin, end - begin) if table is not None else arrow[begin:end]
        for name in names:
            h.update(_column_hashes(part.column(name)).tobytes())
    return h.hexdigest()


def _column_hashes(column) -> np.ndarray:
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return hash_texts(column)
    if column.null_count == 0:
        if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type):
            return hash_token_ids(column)
        if pa.types.is_integer(kind) or pa.types.is_floating(kind):
            return np.ascontiguousarray(column.to_numpy())
    return hash_texts([json.dumps(v, sort_keys=True, default=str) for v in column.to_pylist()])
