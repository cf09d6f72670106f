"""A no-duplicates batch sampler with an exact length.

Contract:

- No text appears twice in a batch, compared across all columns (anchor, positive, negatives): a
  duplicate would be a false in-batch negative. Pre-tokenized columns are compared by their token
  ids, as the model sees them ("A red car." and "a red car. " are one text to an uncased tokenizer).
- A row that collides with the batch being filled is deferred to a later batch, never silently
  dropped. Only with ``drop_last`` can rows left at the end of an epoch (a short last batch, or
  rows that collide with everything left) go unused; :attr:`unplaced` counts them.
- ``len(sampler)`` is exactly the number of batches ``iter(sampler)`` yields for the current epoch,
  so the trainer's step count and LR schedule match the data.
- Same seed and epoch -> same batches; a new epoch -> a new shuffle.

Each text is hashed once (xxh64) at construction; an epoch's batches are then built in one pass
over a permutation (first-fit with a FIFO of deferred rows), about linear in the number of rows.

Distributed training (``world_size`` processes): the duplicate-free batch is the *global* batch of
``batch_size x world_size`` rows, built identically on every rank (same hashes, same seed). The
sampler yields each global batch as ``world_size`` consecutive per-device slices; accelerate's
``BatchSamplerShard`` (applied by the trainer) deals batch ``i`` to rank ``i % world_size``, so rank
``r`` trains on slice ``r`` of every global batch and all ranks run ``len(sampler) / world_size``
steps. Only whole global batches are used then (every rank needs the same batch shape to gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash
from sentence_transformers.base.sampler import DefaultBatchSampler
from sentence_transformers.util import get_world_size

from cembed.data import PreparedData, arrow_table
from cembed.pretokenize import TOKEN_SUFFIX


def hash_texts(texts: list[str]) -> np.ndarray:
    """xxh64 of each UTF-8 text, shape ``(len(texts),)``, dtype uint64."""
    h = xxhash.xxh64_intdigest
    return np.fromiter((h(t.encode("utf-8")) for t in texts), dtype=np.uint64, count=len(texts))


def hash_token_ids(column) -> np.ndarray:
    """xxh64 of each row's token ids (an arrow list column), shape ``(rows,)`` uint64."""
    lists = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    offsets = lists.offsets.to_numpy()
    values = np.ascontiguousarray(lists.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
    h = xxhash.xxh64_intdigest
    return np.fromiter(
        (h(values[offsets[i] : offsets[i + 1]].tobytes()) for i in range(len(offsets) - 1)),
        dtype=np.uint64,
        count=len(offsets) - 1,
    )


def row_hashes(dataset, columns: list[str] | None = None) -> np.ndarray:
    """Hash each of ``columns`` (None: every column but ``dataset_name``; ``[]``: none, shape
    ``(rows, 0)``): shape ``(rows, columns)`` uint64. A column pre-tokenized as
    ``<column>_input_ids`` is hashed by its token ids, the text as the model sees it (casing and
    spacing an uncased tokenizer removes, truncation), else by its text; ``None`` hashes as ``''``."""
    table = arrow_table(dataset)
    if columns is None:
        columns = [c for c in table.column_names if c != "dataset_name"]
    out = np.empty((table.num_rows, len(columns)), dtype=np.uint64)
    for j, col in enumerate(columns):
        if col + TOKEN_SUFFIX in table.column_names:
            out[:, j] = hash_token_ids(table.column(col + TOKEN_SUFFIX))
        else:
            out[:, j] = hash_texts(["" if t is None else str(t) for t in table.column(col).to_pylist()])
    return out


def _fits(hashes: np.ndarray, candidates: np.ndarray, used: np.ndarray) -> np.ndarray:
    """Which candidate rows can join a batch whose texts are ``used`` (sorted), taking the candidates in
    order: a row is refused if any of its texts is in ``used`` or in an earlier candidate row
    (refusing also after an earlier row that was itself refused: conservative, never wrong).
    A text repeated inside one row does not count. Shape ``(len(candidates),)`` bool."""
    h = hashes[candidates]  # (m, k)
    m, k = h.shape
    if m == 0:
        return np.zeros(0, dtype=bool)
    if used.size:
        at = np.minimum(np.searchsorted(used, h), used.size - 1)
        clash = (used[at] == h).any(axis=1)
    else:
        clash = np.zeros(m, dtype=bool)
    flat = h.ravel()
    row_of = np.repeat(np.arange(m), k)
    uniq, first = np.unique(flat, return_index=True)
    first_row = row_of[first][np.searchsorted(uniq, flat)]
    clash |= (first_row != row_of).reshape(m, k).any(axis=1)
    return ~clash


def build_batches(hashes: np.ndarray, batch_size: int, drop_last: bool, seed: int) -> tuple[list[list[int]], int]:
    """Duplicate-free batches for one epoch.

    First fit over a seeded permutation, with a FIFO of deferred rows: each new batch first offers
    a place to the rows deferred so far (oldest first), then takes rows from the permutation; a row
    that shares a text with the batch is deferred. The checks run vectorized on whole candidate
    chunks, so an epoch costs a few numpy passes per batch (about linear in the rows).

    Args:
        hashes: ``(rows, columns)`` text hashes, see :func:`row_hashes`.
        batch_size: rows per batch.
        drop_last: drop the rows that cannot form a full batch at the end of the epoch.
        seed: seed of the shuffle (the sampler passes ``seed + epoch``).

    Returns:
        ``(batches, unplaced)``: lists of row indices, and the number of rows left out (only
        non-zero with ``drop_last``).
    """
    n = hashes.shape[0]
    order = np.random.default_rng(seed).permutation(n)
    batches: list[list[int]] = []
    deferred = np.empty(0, dtype=np.int64)
    pos = 0
    rows: list[np.ndarray] = []
    used = np.empty(0, dtype=hashes.dtype)

    def offer(candidates: np.ndarray) -> np.ndarray:
        """Add the fitting candidates (up to the space left); return the others, in order."""
        nonlocal used
        space = batch_size - sum(len(r) for r in rows)
        ok = _fits(hashes, candidates, used)
        ok[np.cumsum(ok) > space] = False
        taken = candidates[ok]
        if taken.size:
            rows.append(taken)
            used = np.sort(np.concatenate([used, hashes[taken].ravel()]))
        return candidates[~ok]

    def filled() -> int:
        return sum(len(r) for r in rows)

    while True:
        deferred = offer(deferred)
        while filled() < batch_size and pos < n:
            chunk = order[pos : pos + batch_size - filled()]
            pos += len(chunk)
            deferred = np.concatenate([deferred, offer(chunk)])
        if filled() == batch_size:
            batches.append(np.concatenate(rows).tolist())
            rows, used = [], np.empty(0, dtype=hashes.dtype)
            continue
        break  # permutation exhausted and the batch cannot be filled
    if drop_last:
        return batches, filled() + len(deferred)
    # Keep every row: the partial batch, then duplicate-free batches out of what was deferred.
    while rows or len(deferred):
        if rows:
            batches.append(np.concatenate(rows).tolist())
        rows, used = [], np.empty(0, dtype=hashes.dtype)
        deferred = offer(deferred)
    return batches, 0


class NoDuplicatesSampler(DefaultBatchSampler):
    """Drop-in for sentence-transformers' ``NoDuplicatesBatchSampler`` with an exact ``__len__``.

    Pass the class as ``batch_sampler`` in the training arguments; the trainer constructs it with
    ``(dataset, batch_size, drop_last, valid_label_columns, generator, seed)`` and calls
    :meth:`set_epoch` before each epoch.

    ``batch_size`` is the per-device batch. ``world_size`` (default: the initialized
    torch.distributed group's size, else 1) makes the duplicate-free unit the global batch of
    ``batch_size x world_size`` rows, yielded as ``world_size`` consecutive per-device slices (see
    the module docstring); with ``world_size > 1`` a short last global batch is always dropped.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        drop_last: bool,
        valid_label_columns: list[str] | None = None,
        generator=None,
        seed: int = 0,
        world_size: int | None = None,
    ) -> None:
        super().__init__(
            dataset,
            batch_size=batch_size,
            drop_last=drop_last,
            valid_label_columns=valid_label_columns,
            generator=generator,
            seed=seed,
        )
        label_columns = set(valid_label_columns or []) | {"dataset_name"}
        # Only text columns: pre-tokenized datasets also carry <role>_input_ids lists.
        self.columns = [
            c
            for c in dataset.column_names
            if c not in label_columns and getattr(dataset.features[c], "dtype", None) in ("string", "large_string")
        ]
        self.hashes = row_hashes(dataset, self.columns)
        self.world_size = world_size or get_world_size()
        self._cache: tuple[int, list[list[int]], int] | None = None

    def _epoch_batches(self) -> tuple[list[list[int]], int]:
        if self._cache is None or self._cache[0] != self.epoch:
            batches, unplaced = build_batches(
                self.hashes,
                self.batch_size * self.world_size,
                self.drop_last or self.world_size > 1,
                self.seed + self.epoch,
            )
            self._cache = (self.epoch, batches, unplaced)
        return self._cache[1], self._cache[2]

    def global_batches(self) -> list[list[int]]:
        """This epoch's duplicate-free global batches (``batch_size x world_size`` row indices each)."""
        return self._epoch_batches()[0]

    @property
    def unplaced(self) -> int:
        """Rows not used this epoch (``drop_last`` only)."""
        return self._epoch_batches()[1]

    def __iter__(self):
        size = self.batch_size
        for batch in self._epoch_batches()[0]:
            if self.world_size == 1:
                yield batch
            else:
                for rank in range(self.world_size):
                    yield batch[rank * size : (rank + 1) * size]

    def __len__(self) -> int:
        """Per-device batches yielded this epoch: ``world_size x`` the number of global batches."""
        return len(self._epoch_batches()[0]) * self.world_size


def colliding_rows(hashes: np.ndarray) -> np.ndarray:
    """Boolean mask, shape ``(rows,)``: rows sharing any text (in any column) with another row.
    A text repeated inside one row (anchor == positive) does not count."""
    n, k = hashes.shape
    if n == 0:
        return np.zeros(0, dtype=bool)
    srt = np.sort(hashes, axis=1)
    first = np.ones_like(srt, dtype=bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]  # one vote per distinct text per row
    values = srt[first]
    uniq, counts = np.unique(values, return_counts=True)
    shared = counts[np.searchsorted(uniq, srt)] > 1
    return (shared & first).any(axis=1)


def inspect_batches(hashes: np.ndarray, batch_size: int, drop_last: bool, seed: int) -> dict:
    """What ``cembed inspect-data`` reports about duplicate-free batching of ``hashes``.

    Returns:
        ``colliding_share`` (rows sharing a text with another row), ``largest_batch`` (size of a
        maximal duplicate-free batch found greedily: a lower bound of the true maximum),
        ``largest_batch_upper_bound`` (fewest distinct texts in any column), ``batches_per_epoch``
        and ``rows_unplaced`` for ``batch_size`` (epoch 0, ``seed``).
    """
    n = hashes.shape[0]
    greedy, _ = build_batches(hashes, batch_size=max(n, 1), drop_last=False, seed=seed)
    batches, unplaced = build_batches(hashes, batch_size=batch_size, drop_last=drop_last, seed=seed)
    upper = min((len(np.unique(hashes[:, j])) for j in range(hashes.shape[1])), default=n) if n else 0
    return {
        "colliding_share": float(colliding_rows(hashes).mean()) if n else 0.0,
        "largest_batch": len(greedy[0]) if greedy else 0,
        "largest_batch_upper_bound": upper,
        "batches_per_epoch": len(batches),
        "rows_unplaced": unplaced,
    }


@dataclass
class DataReport:
    """What ``cembed inspect-data`` reports: rows, distinct texts per role and batching."""

    source: str
    rows: int
    rows_dropped: int
    batch_size: int  # global batch (per device x world size)
    distinct: dict[str, tuple[str, int]]  # role column -> (source column, distinct texts)
    batching: dict  # :func:`inspect_batches` for batch_size


def inspect_data(data: PreparedData, batch_size: int, drop_last: bool, seed: int) -> DataReport:
    """Distinct texts per column and how the no-duplicates sampler batches ``data`` at
    ``batch_size`` rows (epoch 0, ``seed``)."""
    import pyarrow.compute as pc

    table = arrow_table(data.dataset)
    distinct = {role: (data.roles[role], pc.count_distinct(table.column(role)).as_py()) for role in data.columns}
    batching = inspect_batches(row_hashes(data.dataset, data.columns), batch_size, drop_last, seed)
    return DataReport(data.source, len(data.dataset), data.rows_dropped, batch_size, distinct, batching)
