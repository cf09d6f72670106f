"""Training from a stream: rows read on the fly, tokenized, and cut into windowed no-duplicate batches.

:class:`StreamingSource` reads a file source's shards (:mod:`cembed.data.sources.file_stream`),
tokenizes on the fly, builds the windowed global batches (:mod:`cembed.data.batching.windowed`) and
yields this rank's slice of each; :class:`StreamingRows` hands them to a ``DataLoader``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from cembed.data.batching.windowed import WindowCounts, windowed_batches
from cembed.data.identity import TOKEN_SUFFIX, hash_token_ids
from cembed.data.sources.logs import captured_library_logs
from cembed.data.sources.registry import open_stream, stream_read_error
from cembed.errors import UserError


class StreamingSource:
    """A source's rows read as a stream, tokenized on the fly, in windowed no-duplicate batches.

    The source is opened by its kind's ``open_stream`` hook (:func:`cembed.data.sources.registry.open_stream`;
    a file source: ``datasets.load_dataset(builder, data_files=..., streaming=True)``, shards in
    :func:`cembed.data.sources.file_kind.source_files` order). Each chunk of ``read_rows`` rows is
    tokenized with ``tokenizer`` exactly as pre-tokenization does (special tokens, truncation to
    ``max_seq_length``; no prompts), hashed by its token ids
    (:func:`cembed.data.identity.hash_token_ids`, the text as the model sees it) and fed to a
    :class:`WindowedBatcher` of **global** batches (``batch_size x world_size`` rows).

    With several processes every rank reads the whole stream (the same rows, in the same shuffled
    order) and builds the same global batches; rank ``r`` keeps rows ``[r x B, (r + 1) x B)`` of each,
    the slice accelerate deals a rank of a full-table global batch. So no text repeats anywhere in a
    global batch, whatever the world size, and the global batches are one process's with
    ``batch_size x world_size`` rows (a ``batch.global_batch_size`` run trains the same batches on any
    world size, also across a resume that changes it). The price: each rank reads and tokenizes every
    row, ``world_size`` times the reading of its own slice.

    Iterating yields this rank's slice of each global batch, as a list of row dicts:
    ``{column: text, column + "_input_ids": ids}`` for each of ``columns`` (what
    :class:`cembed.data.tokens.collator.PaddingCollator` pads). :attr:`counts` holds the last
    iteration's :class:`WindowCounts` (of the global batches: the same on every rank), :attr:`earlier`
    the iterations' before it (in this process, oldest first).

    Args:
        source: a source config whose :meth:`~cembed.config.sources.SourceConfig.stream_options` is set
            (a :class:`cembed.config.sources.FileSource`: a file, a folder, a glob, a list of files).
        columns: the text columns, in loss order.
        tokenizer: the model's (fast) tokenizer.
        max_seq_length: tokens per text, special tokens included.
        batch_size: this rank's rows per batch, ``B``; the window rule's batch is ``B x world_size``.
        window: ``W`` of the window rule (global batches).
        rank, world_size: this process and the process count.
        drop_last: see :class:`WindowedBatcher`; with several processes always (only whole global
            batches, as the full-table sampler deals them).
        shuffle_buffer: with a seed, ``IterableDataset.shuffle(seed, buffer_size)`` (shards are
            shuffled too; the same order on every rank); 0: file order.
        seed: the shuffle's seed (``seed + epoch`` via :meth:`set_epoch`).
        read_rows: rows tokenized and hashed at a time.
        names: the keys the rows carry for ``columns``, one each (default: the columns; training
            passes the role columns, ``anchor``, ``positive``, ``negative_1``...).
        max_rows: read only the stream's first ``max_rows`` rows (before the shuffle), as
            ``data.max_samples`` cuts a table; None: every row.

    Raises:
        UserError: the source's files are missing or of an unsupported type (from the loader); while
            reading, a row without one of ``columns`` (a null cell).
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
        """The source's rows (all of them, on every rank) as a ``datasets.IterableDataset``."""
        stream = open_stream(self.source)
        if self.max_rows is not None:
            stream = stream.take(self.max_rows)
        if self.shuffle_buffer:
            stream = stream.shuffle(seed=self.seed + self.epoch, buffer_size=self.shuffle_buffer)
        return stream

    def _read(self) -> Iterator[dict[str, list]]:
        """The stream's rows, ``read_rows`` at a time; a library error while reading is a UserError in
        one line with its cause and the file the library names
        (:func:`cembed.data.sources.registry.stream_read_error`)."""
        chunks = iter(self.dataset().iter(batch_size=self.read_rows))
        while True:
            with captured_library_logs() as records:
                try:
                    chunk = next(chunks)
                except StopIteration:
                    return
                except UserError:
                    raise
                except Exception as err:  # datasets and pyarrow raise many types
                    raise UserError(stream_read_error(self.source.label, err, records)) from None
            yield chunk

    def _chunks(self) -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        import pyarrow as pa

        for chunk in self._read():
            n = len(chunk[self.columns[0]])
            hashes = np.empty((n, len(self.columns)), dtype=np.uint64)
            ids_by_column = {}
            for j, column in enumerate(self.columns):
                texts = chunk[column]
                if any(t is None for t in texts):  # a data mistake, the same on every attempt: exit 2, no restart
                    raise UserError(
                        f"{self.source.label}: a row has no {column!r} (null cell); streaming needs every column "
                        "(only the first data.train.streaming.check_rows rows are checked before training): fill "
                        "or drop the row"
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
        width, start = self.batch_size * self.world_size, self.rank * self.batch_size
        drop_last = self.drop_last or self.world_size > 1  # every rank a full slice: the same steps on all
        for batch in windowed_batches(self._chunks(), width, self.window, drop_last, self.counts):
            yield batch[start : start + self.batch_size]


class StreamingRows(torch.utils.data.IterableDataset):
    """The rows of a stream's windowed batches, one at a time in batch order, for a ``DataLoader``
    with ``batch_size=B`` and no sampler: its batches are then exactly the windowed batches (every
    batch but the last holds ``B`` rows, and the DataLoader cuts every ``B`` rows).

    Args:
        batches: an iterable of batches, each a list of rows, re-iterable once per epoch (a
            :class:`StreamingSource`: rows are ``{column: text, column + "_input_ids": ids}``, which
            :class:`cembed.data.tokens.collator.PaddingCollator` pads).

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
    """The training rows of ``data``'s streamed source (a :class:`cembed.data.rows.TrainingData`
    whose one source sets ``data.train.streaming``): this rank's :class:`StreamingSource` (its
    ``batch_size``-row slice of each global batch of ``batch_size x world_size`` rows, the source's
    window, shuffle buffer and ``max_samples``; the
    shuffle seeded by ``seed``) as endless :class:`StreamingRows` (pass after pass, each pass's short
    last batch dropped), with the :class:`PaddingCollator` that pads its token ids.

    Returns:
        ``(rows, collator, info)``: ``info`` for ``run_summary.json``'s ``tokenization``.

    Raises:
        UserError: the model's inputs are more than token ids (no PaddingCollator for it), or its kind
            tokenizes a column otherwise than the stream (another length, query expansion, no special tokens).
    """
    from cembed.data.tokens.collator import collator_for
    from cembed.data.tokens.model_check import column_layouts

    src = data.sources[0]
    item = src.stream  # the TrainSource
    options = item.source.stream_options()
    collator = collator_for(model, data.columns, pad_to_multiple_of)
    if collator is None:
        raise UserError(
            f"{src.key}.streaming: the model's inputs are more than token ids (or its tokenizer pads on the left), "
            "which a stream cannot produce; drop streaming"
        )
    layouts = column_layouts(model, data.columns)
    if (
        layouts is None
        or layouts.expansions
        or layouts.strips
        or set(layouts.lengths.values()) != {model.max_seq_length}
    ):
        raise UserError(
            f"{src.key}.streaming: the model tokenizes its columns differently (e.g. an inference-free sparse model's "
            "queries without special tokens), and a stream is tokenized one way for every column; train from the "
            "files (or a prepared folder: cembed prepare-data)"
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
