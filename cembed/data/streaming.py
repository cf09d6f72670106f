"""No-duplicate batches over a stream of rows, for corpora past what a node can memory-map.

The full-table sampler (:class:`cembed.data.sampler.NoDuplicatesSampler`) sees every row's hashes
before it builds an epoch. A stream shows its rows once, in order, so the same rule can only look a
bounded number of rows ahead and keep a bounded number of refused rows. :class:`WindowedBatcher`
does that with a window of ``W`` batches:

- **A batch never holds two rows sharing a text**, compared across all columns (anchor, positive,
  negatives), exactly as the full-table sampler compares them (the same hashes,
  :func:`cembed.data.sampler.row_hashes` / :func:`~cembed.data.sampler.hash_token_ids`): a
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
sampler's permutation the batches are exactly :func:`cembed.data.sampler.build_batches_flat`'s (the
same first fit with a FIFO of deferred rows, tested). The checks run vectorised on candidate chunks
(:func:`cembed.data.sampler.fits`): ``scripts/bench_window.py`` measures the rows per second.

In a stream the batch is what one process sees: with ``world_size`` processes each rank batches its
own rows (:func:`datasets.distributed.split_dataset_by_node`), so the rule holds within a rank's
batch, not across the ranks' slices of a gathered global batch.

:class:`StreamingSource` reads a file source's shards with ``datasets``' streaming loader, splits
them between ranks, tokenizes on the fly and yields the windowed batches; :class:`StreamingRows`
hands them to a ``DataLoader`` (``batch_size=B``, no sampler) row by row, in batch order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cembed.data.collator import TOKEN_SUFFIX
from cembed.data.sampler import fits, hash_token_ids
from cembed.errors import UserError


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
        column, as :func:`cembed.data.sampler.row_hashes` gives). Returns the batches completed
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


class StreamingSource:
    """A file source's rows read as a stream, tokenized on the fly, in windowed no-duplicate batches.

    The shards are read with ``datasets.load_dataset(builder, data_files=..., streaming=True)``
    (shards in :func:`cembed.data.sources.source_files` order) and split between processes with
    :func:`datasets.distributed.split_dataset_by_node` (whole shards per rank when the shard count
    divides by ``world_size``, else every ``world_size``-th row). Each chunk of ``read_rows`` rows is
    tokenized with ``tokenizer`` exactly as pre-tokenization does (special tokens, truncation to
    ``max_seq_length``; no prompts), hashed by its token ids
    (:func:`cembed.data.sampler.hash_token_ids`, the text as the model sees it) and fed to a
    :class:`WindowedBatcher`.

    Iterating yields batches as lists of row dicts: ``{column: text, column + "_input_ids": ids}``
    for each of ``columns`` (what :class:`cembed.data.collator.PaddingCollator` pads). :attr:`counts`
    holds the last iteration's :class:`WindowCounts`, :attr:`earlier` the iterations' before it (in
    this process, oldest first).

    Args:
        source: a :class:`cembed.config.data.FileSource` (a file, a folder, a glob, a list of files).
        columns: the text columns, in loss order.
        tokenizer: the model's (fast) tokenizer.
        max_seq_length: tokens per text, special tokens included.
        batch_size: ``B`` of the window rule (this rank's batch).
        window: ``W`` of the window rule.
        rank, world_size: this process and the process count.
        drop_last: see :class:`WindowedBatcher`.
        shuffle_buffer: with a seed, ``IterableDataset.shuffle(seed, buffer_size)`` before the split
            (shards are shuffled too); 0: file order.
        seed: the shuffle's seed (``seed + epoch`` via :meth:`set_epoch`).
        read_rows: rows tokenized and hashed at a time.
        names: the keys the rows carry for ``columns``, one each (default: the columns; training
            passes the role columns, ``anchor``, ``positive``, ``negative_1``...).
        max_rows: read only the stream's first ``max_rows`` rows (before the shuffle and the split),
            as ``data.max_samples`` cuts a table; None: every row.

    Raises:
        UserError: the source's files are missing or of an unsupported type (from the loader).
        ValueError: a row without one of ``columns`` (a null cell).
    """

    def __init__(
        self,
        source,
        columns: list[str],
        tokenizer,
        max_seq_length: int,
        batch_size: int,
        window: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        shuffle_buffer: int = 0,
        seed: int = 0,
        read_rows: int = 4096,
        names: list[str] | None = None,
        max_rows: int | None = None,
    ) -> None:
        self.source, self.columns = source, list(columns)
        self.names = list(names) if names is not None else list(columns)
        if len(self.names) != len(self.columns):
            raise ValueError(f"names {self.names} must name each of the columns {self.columns}")
        self.max_rows = max_rows
        self.tokenizer, self.max_seq_length = tokenizer, max_seq_length
        self.batch_size, self.window, self.drop_last = batch_size, window, drop_last
        self.rank, self.world_size = rank, world_size
        self.shuffle_buffer, self.seed, self.epoch = shuffle_buffer, seed, 0
        self.read_rows = read_rows
        self.counts = WindowCounts()
        self.earlier: list[WindowCounts] = []

    def set_epoch(self, epoch: int) -> None:
        """The next iteration's epoch (a new shuffle where ``shuffle_buffer`` is set)."""
        self.epoch = epoch

    def dataset(self):
        """This rank's part of the source as a ``datasets.IterableDataset``."""
        from datasets.distributed import split_dataset_by_node

        stream = open_stream(self.source)
        if self.max_rows is not None:
            stream = stream.take(self.max_rows)
        if self.shuffle_buffer:
            stream = stream.shuffle(seed=self.seed + self.epoch, buffer_size=self.shuffle_buffer)
        return split_dataset_by_node(stream, rank=self.rank, world_size=self.world_size)

    def _chunks(self) -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        import pyarrow as pa

        for chunk in self.dataset().iter(batch_size=self.read_rows):
            n = len(chunk[self.columns[0]])
            hashes = np.empty((n, len(self.columns)), dtype=np.uint64)
            ids_by_column = {}
            for j, column in enumerate(self.columns):
                texts = chunk[column]
                if any(t is None for t in texts):
                    raise ValueError(
                        f"{self.source.label}: a row has no {column!r} (null cell); streaming needs every column"
                    )
                ids = self.tokenizer(
                    texts,
                    truncation=True,
                    max_length=self.max_seq_length,
                    add_special_tokens=True,
                    return_attention_mask=False,
                    return_token_type_ids=False,
                )["input_ids"]
                hashes[:, j] = hash_token_ids(pa.array(ids, type=pa.list_(pa.int32())))
                ids_by_column[column] = ids
            pairs = list(zip(self.columns, self.names))
            rows = [
                {
                    key: value
                    for c, name in pairs
                    for key, value in ((name, chunk[c][i]), (name + TOKEN_SUFFIX, ids_by_column[c][i]))
                }
                for i in range(n)
            ]
            yield hashes, rows

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        if self.counts.rows_read:
            self.earlier.append(self.counts)
        self.counts = WindowCounts()
        yield from windowed_batches(self._chunks(), self.batch_size, self.window, self.drop_last, self.counts)


def open_stream(source):
    """A :class:`cembed.config.data.FileSource`'s files (:func:`cembed.data.sources.source_files`
    order) as one ``datasets.IterableDataset``, read lazily in file order.

    Raises:
        UserError: the files are missing or of an unsupported type.
    """
    import datasets

    from cembed.data.sources import builder_for, source_files

    files = source_files(source)
    builder, kwargs = builder_for(files[0])
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False  # a local file is nobody's download
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True, **kwargs)


def read_head(source, rows: int):
    """The first ``rows`` rows of a file source read as a stream (file order, no shuffle, no split),
    as an in-memory ``datasets.Dataset``: what ``validate`` and ``train`` check of a streamed source
    (columns, cells) without reading the rest.

    Raises:
        UserError: see :func:`open_stream`.
    """
    import datasets

    return datasets.Dataset.from_list(list(open_stream(source).take(rows)))


class StreamingRows(torch.utils.data.IterableDataset):
    """The rows of a stream's windowed batches, one at a time in batch order, for a ``DataLoader``
    with ``batch_size=B`` and no sampler: its batches are then exactly the windowed batches (every
    batch but the last holds ``B`` rows, and the DataLoader cuts every ``B`` rows).

    Args:
        batches: an iterable of batches, each a list of rows, re-iterable once per epoch (a
            :class:`StreamingSource`: rows are ``{column: text, column + "_input_ids": ids}``, which
            :class:`cembed.data.collator.PaddingCollator` pads).

    :meth:`set_epoch` passes the epoch on (a new shuffle where the source shuffles). The stream is
    read in one process: with ``num_workers`` > 1 each worker would read and tokenize the whole
    stream, so iterating in such a worker raises ``RuntimeError`` (use 0 or 1 data-loader worker).

    ``endless``: one iteration reads pass after pass (epoch ``e``, ``e + 1``, ... from the last
    :meth:`set_epoch`, each a new shuffle) until the reader stops, or a pass yields no batch. Training
    uses it: the run is one unbounded epoch that ``max_steps`` ends, so skipping the first ``n``
    batches (a resumed run) lands where the uninterrupted run was, whatever pass that is. The source's
    batches must then all be full (``drop_last``), so that every ``B`` rows stay one batch.
    """

    def __init__(self, batches: Iterable[list[Any]], endless: bool = False) -> None:
        self.batches = batches
        self.endless = endless
        self._first = 0  # the pass an endless iteration starts with

    def set_epoch(self, epoch: int) -> None:
        """The next iteration's epoch (forwarded to the source where it has ``set_epoch``)."""
        self._first = epoch
        if hasattr(self.batches, "set_epoch"):
            self.batches.set_epoch(epoch)

    def _passes(self) -> Iterator[list[Any]]:
        epoch = self._first
        while True:
            if hasattr(self.batches, "set_epoch"):
                self.batches.set_epoch(epoch)
            empty = True
            for batch in self.batches:
                empty = False
                yield batch
            if empty:  # nothing to train on: stop rather than read empty passes forever
                return
            epoch += 1

    def __iter__(self) -> Iterator[Any]:
        worker = torch.utils.data.get_worker_info()
        if worker is not None and worker.num_workers > 1:
            raise RuntimeError(
                f"a streaming source is read by one data-loader process, got {worker.num_workers} workers; "
                "set dataloader_num_workers to 0 or 1"
            )
        for batch in self._passes() if self.endless else self.batches:
            yield from batch


def check_stream_prompts(prompts, columns: list[str], key: str = "data.train") -> None:
    """Refuse prompts for a streamed source: it is tokenized without them.

    Args:
        prompts: the run's resolved :class:`cembed.model.prompts.RolePrompts` (``data.prompts`` or the model's own).
        columns: the role columns trained; key: the source's config field (``data.train``).

    Raises:
        UserError: a column would get a non-empty prompt, naming where it comes from and the fix.
    """
    given = prompts.for_columns(columns)
    if not given:
        return
    column, text = next(iter(given.items()))
    role = column if column in ("anchor", "positive") else "negatives"
    origin = prompts.origin.get(role, "the model's prompts")
    raise UserError(
        f"{key}.streaming: a stream is tokenized without prompts, but {column} gets {text!r} ({origin}); "
        f"set data.prompts.{role}: '' or drop streaming"
    )


def training_stream(
    data,
    model,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    pad_to_multiple_of: int | None = None,
) -> tuple[StreamingRows, Any, dict]:
    """The training rows of ``data``'s streamed source (a :class:`cembed.data.prepare.PreparedData`
    whose one source sets ``data.train.streaming``): this rank's :class:`StreamingSource` (its
    ``batch_size`` rows per batch, the source's window, shuffle buffer and ``max_samples``; the
    shuffle seeded by ``seed``) as endless :class:`StreamingRows` (pass after pass, each pass's short
    last batch dropped), with the :class:`PaddingCollator` that pads its token ids.

    Returns:
        ``(rows, collator, info)``: ``info`` for ``run_summary.json``'s ``tokenization``.

    Raises:
        UserError: the model's inputs are more than token ids (no PaddingCollator for it).
    """
    from cembed.data.collator import collator_for

    src = data.sources[0]
    item = src.stream  # the TrainSource
    options = item.source.streaming
    collator = collator_for(model, data.columns, pad_to_multiple_of)
    if collator is None:
        raise UserError(
            f"{src.key}.streaming: the model's inputs are more than token ids (or its tokenizer pads on the left), "
            "which a stream cannot produce; drop streaming"
        )
    source = StreamingSource(
        item.source,
        [data.roles[c] for c in data.columns],
        model.tokenizer,
        model.max_seq_length,
        batch_size,
        options.window_batches,
        rank,
        world_size,
        True,  # every batch full: the endless rows are cut every batch_size rows across passes
        options.shuffle_buffer,
        seed,
        names=data.columns,
        max_rows=item.max_samples,
    )
    info = {"pretokenized": False, "streaming": True, "reason": "a streaming source is tokenized on the fly"}
    return StreamingRows(source, endless=True), collator, info
