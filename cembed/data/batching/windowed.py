"""No-duplicate batches over a stream of rows, for corpora past what a node can memory-map.

The full-table sampler (:class:`cembed.data.batching.full_table.NoDuplicatesSampler`) sees every row's hashes
before it builds an epoch. A stream shows its rows once, in order, so the same rule can only look a
bounded number of rows ahead and keep a bounded number of refused rows. :class:`WindowedBatcher`
does that with a window of ``W`` batches:

- **A batch never holds two rows sharing a text**, compared across all columns (anchor, positive,
  negatives), exactly as the full-table sampler compares them (the same hashes,
  :func:`cembed.data.identity.row_hashes` / :func:`~cembed.data.identity.hash_token_ids`): a
  duplicate would be a false in-batch negative.
- Each batch is a first fit: it first offers a place to the deferred rows (oldest first), then takes
  rows from the stream in order; a row that shares a text with a row already *taken* into the batch
  is **deferred**: it stays in the buffer for later batches.
- A deferred row may join any of the next ``W`` batches; if it has joined none of them, it is
  **dropped** (counted), never placed as a duplicate. The deferred rows are at most ``W x B``
  (``B``: the batch size); should one batch's refusals overflow that, the oldest deferred rows are
  dropped first. ``W = 0``: a refused row is dropped at once (no deferral). Rows buffered: at most
  ``(W + 1) x B`` (the deferred rows and the batch being filled), plus the chunk being read.
- Every batch but the end's is full (``B`` rows). At the end of the stream the partial batch and the
  deferred rows are packed, first fit, into further batches, as the full-table sampler ends an
  epoch: full ones are kept; with ``drop_last`` the short ones go unused, without it the largest
  short one (2+ rows) is kept as the last batch. Rows not batched at the end are ``left_at_end``.

With ``W`` at least the number of batches in the stream nothing is dropped, and fed the full-table
sampler's permutation the batches are exactly :func:`cembed.data.batching.full_table.build_batches_flat`'s (the
same first fit with a FIFO of deferred rows, tested). The checks run vectorised on candidate chunks
(:func:`cembed.data.batching.fits.fits`): ``scripts/bench_window.py`` measures the rows per second.

With several processes the rule's batch is the global one: every rank reads the whole stream, builds
the same windowed batches of ``B x world_size`` rows and trains its slice of each
(:class:`cembed.data.batching.stream.StreamingSource`), so the rule holds across the ranks' slices of a
gathered global batch, as the full-table sampler's does.

:class:`StreamingSource` reads a file source's shards with ``datasets``' streaming loader, tokenizes
on the fly and yields this rank's slice of each windowed batch; :class:`StreamingRows` hands them to
a ``DataLoader`` (``batch_size=B``, no sampler) row by row, in batch order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cembed.data.batching.fits import fits


@dataclass
class WindowCounts:
    """What a :class:`WindowedBatcher` did with the rows it read.

    ``rows_read == placed + dropped + left_at_end + buffered`` (``buffered`` is 0 after
    :meth:`WindowedBatcher.finish`)."""

    rows_read: int = 0
    batches: int = 0  # batches yielded (full ones, and a short last one without drop_last)
    placed: int = 0  # rows in those batches
    dropped: int = 0  # rows refused and not placed within their window (or a full buffer's oldest)
    deferred: int = 0  # rows refused at least once by the batch being filled (placed later or dropped)
    left_at_end: int = 0  # end-of-stream rows in no batch (a short batch under drop_last, a 1-row one)
    buffered: int = 0  # rows held now (deferred, or in the batch being filled)


class WindowedBatcher:
    """The window rule of this module (see its docstring) over rows pushed in chunks.

    Args:
        batch_size: ``B``, rows per batch (>= 1).
        window: ``W``, how many later batches a deferred row may join (>= 0).
        drop_last: at the end of the stream, drop a short last batch (else keep the largest, 2+ rows).

    :meth:`push` takes a chunk of rows' hashes and returns the batches it completes; :meth:`finish`
    returns the end's batches. A batch is an int64 array of the rows' positions in the stream
    (0 = the first row pushed), in the order the rows were taken. :attr:`counts` holds the
    :class:`WindowCounts`.

    Raises:
        ValueError: ``batch_size < 1``, ``window < 0``, hashes of another column count than the first
            chunk's, or a push after :meth:`finish`.
    """

    def __init__(self, batch_size: int, window: int, drop_last: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if window < 0:
            raise ValueError(f"window must be >= 0 batches, got {window}")
        self.batch_size, self.window, self.drop_last = batch_size, window, drop_last
        self.counts = WindowCounts()
        self._columns: int | None = None
        self._next = 0  # stream position of the next row pushed
        self._finished = False
        # Deferred rows, oldest first: hashes (m, k), stream positions, batches waited (-1: refused
        # by the batch being filled, which does not count as one of its W).
        self._pend_h = np.empty((0, 0), dtype=np.uint64)
        self._pend_seq = np.empty(0, dtype=np.int64)
        self._pend_age = np.empty(0, dtype=np.int64)
        self._dropped: list[np.ndarray] = []  # positions dropped since the last pop_dropped()
        self._reset_batch()

    # --- the batch being filled ---------------------------------------------------------------

    def _reset_batch(self) -> None:
        self._parts: list[np.ndarray] = []
        self._used = np.empty(0, dtype=np.uint64)  # sorted texts of the batch being filled
        self._filled = 0
        self._started = False  # whether the deferred rows were offered to this batch yet

    def _take(self, h: np.ndarray, seq: np.ndarray) -> None:
        if len(seq):
            self._parts.append(seq)
            self._used = np.sort(np.concatenate([self._used, h.ravel()]))
            self._filled += len(seq)

    def _offer_deferred(self) -> None:
        self._started = True
        if not len(self._pend_seq):
            return
        ok = fits(self._pend_h, np.arange(len(self._pend_seq)), self._used, self.batch_size - self._filled)
        self._take(self._pend_h[ok], self._pend_seq[ok])
        self._pend_h, self._pend_seq, self._pend_age = self._pend_h[~ok], self._pend_seq[~ok], self._pend_age[~ok]

    def _defer(self, h: np.ndarray, seq: np.ndarray) -> None:
        self.counts.deferred += len(seq)
        self._pend_h = np.concatenate([self._pend_h, h])
        self._pend_seq = np.concatenate([self._pend_seq, seq])
        self._pend_age = np.concatenate([self._pend_age, np.full(len(seq), -1, dtype=np.int64)])
        over = len(self._pend_seq) - self.window * self.batch_size
        if over > 0:  # the buffer's bound: the oldest deferred rows go first
            self.counts.dropped += over
            self._dropped.append(self._pend_seq[:over])
            self._pend_h, self._pend_seq, self._pend_age = (
                self._pend_h[over:],
                self._pend_seq[over:],
                self._pend_age[over:],
            )

    def _batch(self) -> np.ndarray:
        return np.concatenate(self._parts) if self._parts else np.empty(0, dtype=np.int64)

    def _emit(self) -> np.ndarray:
        """Close the full batch: count it, age the deferred rows, drop those past their window."""
        batch = self._batch()
        self.counts.batches += 1
        self.counts.placed += len(batch)
        self._pend_age += 1
        keep = self._pend_age < self.window
        self.counts.dropped += int((~keep).sum())
        if not keep.all():
            self._dropped.append(self._pend_seq[~keep])
        self._pend_h, self._pend_seq, self._pend_age = self._pend_h[keep], self._pend_seq[keep], self._pend_age[keep]
        self._reset_batch()
        return batch

    # --- public -------------------------------------------------------------------------------

    def push(self, hashes: np.ndarray) -> list[np.ndarray]:
        """Read a chunk of rows: ``hashes`` of shape ``(rows, columns)`` uint64 (one text hash per
        column, as :func:`cembed.data.identity.row_hashes` gives). Returns the batches completed
        (int64 stream positions each, ``B`` rows), possibly none."""
        if self._finished:
            raise ValueError("push after finish: the stream has ended")
        hashes = np.asarray(hashes, dtype=np.uint64)
        if hashes.ndim != 2:
            raise ValueError(f"hashes must be (rows, columns), got shape {hashes.shape}")
        if self._columns is None:
            self._columns = hashes.shape[1]
            self._pend_h = np.empty((0, self._columns), dtype=np.uint64)
        elif hashes.shape[1] != self._columns:
            raise ValueError(f"hashes have {hashes.shape[1]} columns, earlier chunks {self._columns}")
        n = len(hashes)
        seq = np.arange(self._next, self._next + n, dtype=np.int64)
        self._next += n
        self.counts.rows_read += n
        out, pos, size = [], 0, self.batch_size
        while True:
            if not self._started:
                self._offer_deferred()
            while self._filled < size and pos < n:
                # A chunk no longer than the space left: every candidate is taken or refused, none
                # is passed over (the first fit's decision for each row it reads).
                idx = np.arange(pos, min(pos + size - self._filled, n))
                pos = int(idx[-1]) + 1
                ok = fits(hashes, idx, self._used, size - self._filled)
                self._take(hashes[idx[ok]], seq[idx[ok]])
                if not ok.all():
                    self._defer(hashes[idx[~ok]], seq[idx[~ok]])
            if self._filled < size:
                break
            out.append(self._emit())
        self.counts.buffered = self._filled + len(self._pend_seq)
        return out

    def pop_dropped(self) -> np.ndarray:
        """Stream positions of the rows dropped since the last call (int64), e.g. to free their payloads."""
        out = np.concatenate(self._dropped) if self._dropped else np.empty(0, dtype=np.int64)
        self._dropped = []
        return out

    def finish(self) -> list[np.ndarray]:
        """End of the stream: pack the partial batch and the deferred rows, first fit, into further
        batches (see the module docstring). Returns them; afterwards nothing is buffered."""
        if self._finished:
            return []
        self._finished = True
        if not self._started:
            self._offer_deferred()
        out: list[np.ndarray] = []
        short = np.empty(0, dtype=np.int64)
        while self._filled or len(self._pend_seq):
            if self._filled == self.batch_size:
                out.append(self._emit())
            else:
                batch = self._batch()
                if not self.drop_last and len(batch) > len(short) and len(batch) >= min(2, self.batch_size):
                    self.counts.left_at_end += len(short)
                    short = batch
                else:
                    self.counts.left_at_end += len(batch)
                self._reset_batch()
            self._offer_deferred()
        if len(short):
            out.append(short)
            self.counts.batches += 1
            self.counts.placed += len(short)
        self.counts.buffered = 0
        return out


def windowed_batches(
    chunks: Iterable[tuple[np.ndarray, Sequence[Any]]],
    batch_size: int,
    window: int,
    drop_last: bool = True,
    counts: WindowCounts | None = None,
) -> Iterator[list[Any]]:
    """The windowed batches of a stream given as chunks of ``(hashes, payloads)``: ``hashes``
    ``(rows, columns)`` uint64 (see :meth:`WindowedBatcher.push`), ``payloads`` one object per row
    (e.g. the row's token ids). Yields each batch as the list of its rows' payloads, in the order
    taken. ``counts``: a :class:`WindowCounts` to fill (read it after the last batch).
    Payloads are held only while their row is buffered."""
    batcher = WindowedBatcher(batch_size, window, drop_last)
    if counts is not None:
        batcher.counts = counts
    held: dict[int, Any] = {}
    for hashes, payloads in chunks:
        start = batcher.counts.rows_read
        if len(payloads) != len(hashes):
            raise ValueError(f"a chunk has {len(hashes)} rows of hashes and {len(payloads)} payloads")
        held.update(zip(range(start, start + len(payloads)), payloads))
        for batch in batcher.push(hashes):
            yield [held.pop(i) for i in batch.tolist()]
        for i in batcher.pop_dropped().tolist():
            del held[i]
    for batch in batcher.finish():
        yield [held.pop(i) for i in batch.tolist()]
    held.clear()
