"""A no-duplicates batch sampler with an exact length.

Contract:

- No text appears twice in a batch, compared across all columns (anchor, positive, negatives): a
  duplicate would be a false in-batch negative. Pre-tokenized columns are compared by their token
  ids, as the model sees them ("A red car." and "a red car. " are one text to an uncased tokenizer).
- A row that collides with the batch being filled is deferred to a later batch, never silently
  dropped. The batches are exactly a row-by-row first fit's over the same order (a row is refused
  only for a text it shares with a row *taken* into the batch). With ``drop_last``, rows left at the
  end of an epoch (a short last batch, rows that collide with everything left) go unused; without
  it, one short last batch is kept (the largest the leftover rows form, never a single row: no
  in-batch negative, loss 0) and the other leftover rows go unused. Every other batch is full, so
  the batch size the plan states (and scales the learning rate for) is the one that trains.
  :attr:`unplaced` counts the unused rows.
- ``len(sampler)`` is exactly the number of batches ``iter(sampler)`` yields for the current epoch,
  so the trainer's step count and LR schedule match the data, and it is the same in every epoch:
  the trainer plans each epoch, ``train.max_steps`` and a resume's place with the first epoch's
  length (transformers' loop runs that many steps per epoch). On duplicate-heavy data the rows a
  first fit leaves over depend on the shuffle, so an epoch's own first fit can give a batch more or
  less than the first epoch's (sentence-transformers#3348): a longer epoch keeps its first batches
  (the rest count as unplaced), a shorter one is completed with full batches of a further shuffle
  (:data:`REFILL_SEED_STRIDE`; their rows train twice that epoch), each batch duplicate-free.
- Same seed and epoch -> same batches; a new epoch -> a new shuffle.

Each text is hashed once at construction (token ids: :func:`hash_token_ids`, vectorised; raw
text: xxh64), record batch by record batch; an epoch's batches are then built in one pass
over a permutation (first-fit with a FIFO of deferred rows), about linear in the number of rows
(:func:`build_batches`; :func:`build_batches_row_by_row` is the same, row by row, as a reference).

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
from sentence_transformers.base.sampler import DefaultBatchSampler
from sentence_transformers.util import get_world_size

from cembed.data.batching.fits import fits
from cembed.data.batching.mixture import SourceMix
from cembed.data.identity import TOKEN_SUFFIX, compared_columns, row_hashes

# Source i of a mixture is shuffled with seed + epoch + i x this (source 0: the single-source shuffle).
SOURCE_SEED_STRIDE = 1_000_003
# The k-th further shuffle that completes an epoch shorter than the first: seed + epoch + k x this.
REFILL_SEED_STRIDE = 7_919_993


@dataclass(frozen=True)
class EpochPlan:
    """One epoch of several sources: each source's duplicate-free batches (:func:`build_batches_flat`)
    and the schedule that takes them (:meth:`cembed.data.batching.mixture.SourceMix.schedule`). The
    sampler trains on exactly this; ``validate`` reads the rows it leaves unused from it.

    Attributes:
        rows: per source, its batches' dataset row indices, one flat int64 array.
        bounds: per source, its batches' offsets into ``rows`` (``len(bounds) - 1`` batches).
        sizes: per source, its rows in the dataset.
        order: the source index of each global batch of the epoch, in training order.
    """

    rows: list[np.ndarray]
    bounds: list[np.ndarray]
    sizes: tuple[int, ...]
    order: list[int]

    @property
    def taken(self) -> list[int]:
        """Per source, the batches the schedule takes: always its first ones."""
        return [self.order.count(i) for i in range(len(self.rows))]

    @property
    def used(self) -> list[int]:
        """Per source, the rows its taken batches hold: the rows the epoch trains on."""
        return [int(b[t]) for b, t in zip(self.bounds, self.taken)]

    @property
    def unused(self) -> list[int]:
        """Per source, its rows the epoch does not train on: those no batch holds and those in
        batches the schedule leaves out (round_robin, weighted)."""
        return [n - u for n, u in zip(self.sizes, self.used)]


def plan_epoch(hashes: np.ndarray, mix: SourceMix, batch_size: int, drop_last: bool, seed: int) -> EpochPlan:
    """The :class:`EpochPlan` of the rows with ``hashes`` (all sources', shape ``(rows, columns)``,
    in ``mix.sizes`` order) for global batches of ``batch_size``: source ``i`` is shuffled with
    ``seed + i x SOURCE_SEED_STRIDE`` (``seed``: the sampler's seed + epoch)."""
    rows, bounds = [], []
    for i, (offset, n) in enumerate(zip(mix.offsets, mix.sizes)):
        placed, cuts, _ = build_batches_flat(
            hashes[offset : offset + n], batch_size, drop_last, seed + i * SOURCE_SEED_STRIDE
        )
        placed += offset  # in place: the array is this call's own
        rows.append(placed)
        bounds.append(cuts)
    return EpochPlan(rows, bounds, tuple(mix.sizes), mix.schedule([len(b) - 1 for b in bounds]))


def build_batches(hashes: np.ndarray, batch_size: int, drop_last: bool, seed: int) -> tuple[list[list[int]], int]:
    """Duplicate-free batches for one epoch as lists of row indices: :func:`build_batches_flat`'s
    batches, one list each, and its ``unplaced``."""
    rows, bounds, unplaced = build_batches_flat(hashes, batch_size, drop_last, seed)
    return [rows[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])], unplaced


def build_batches_flat(
    hashes: np.ndarray, batch_size: int, drop_last: bool, seed: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Duplicate-free batches for one epoch: exactly :func:`build_batches_row_by_row`'s, vectorised.

    First fit over a seeded permutation, with a FIFO of deferred rows: each new batch first offers
    a place to the rows deferred so far (oldest first), then takes rows from the permutation; a row
    that shares a text with the batch is deferred. The checks run vectorised on whole candidate
    chunks (:func:`fits`), so an epoch costs a few numpy passes per batch (about linear in the rows).

    The end of an epoch: with ``drop_last`` the rows that cannot fill a batch go unused. Without it,
    the partial batch and the deferred rows are packed, first fit, into further batches: the full
    ones are kept, and of the short ones only the largest, as the epoch's one short last batch, if
    it has 2+ rows (a 1-row batch has no in-batch negative: it trains at loss 0); the other rows go
    unused (counted in ``unplaced``, reported by :mod:`cembed.data.batching.placement`). Every batch but the
    last is full: no row is moved out of a full batch to give a leftover row company.

    Args:
        hashes: ``(rows, columns)`` text hashes, see :func:`row_hashes`.
        batch_size: rows per batch.
        drop_last: drop the rows that cannot form a full batch at the end of the epoch.
        seed: seed of the shuffle (the sampler passes ``seed + epoch``).

    Returns:
        ``(rows, bounds, unplaced)``: the batches' row indices one after another (int64, one per
        placed row), batch ``i`` being ``rows[bounds[i]:bounds[i + 1]]`` (``bounds``: int64, one more
        than the batches), and the number of rows left out.
    """
    n = hashes.shape[0]
    order = np.random.default_rng(seed).permutation(n)
    batches: list[np.ndarray] = []
    deferred = np.empty(0, dtype=np.int64)
    pos = 0
    rows: list[np.ndarray] = []
    used = np.empty(0, dtype=hashes.dtype)

    def filled() -> int:
        return sum(len(r) for r in rows)

    def offer(candidates: np.ndarray) -> np.ndarray:
        """Add the fitting candidates (up to the space left); return the others, in order."""
        nonlocal used
        ok = fits(hashes, candidates, used, batch_size - filled())
        taken = candidates[ok]
        if taken.size:
            rows.append(taken)
            used = np.sort(np.concatenate([used, hashes[taken].ravel()]))
        return candidates[~ok]

    while True:
        deferred = offer(deferred)
        while filled() < batch_size and pos < n:
            chunk = order[pos : pos + batch_size - filled()]
            pos += len(chunk)
            deferred = np.concatenate([deferred, offer(chunk)])
        if filled() == batch_size:
            batches.append(np.concatenate(rows))
            rows, used = [], np.empty(0, dtype=hashes.dtype)
            continue
        break  # permutation exhausted and the batch cannot be filled
    if drop_last:
        return (*_flat(batches), filled() + len(deferred))
    # The rows left: the partial batch, then batches out of what was deferred (first fit). A full one
    # is kept; of the short ones only the largest (the first on a tie) is, as the epoch's one short
    # last batch, and only with 2+ rows (a 1-row batch has no in-batch negative: loss 0). No row is
    # ever moved out of a full batch: the plan's batch size and learning rate hold for every batch.
    short = np.empty(0, dtype=np.int64)
    unplaced = 0
    while rows or len(deferred):
        batch = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
        if len(batch) == batch_size:
            batches.append(batch)
        elif len(batch) > len(short) and len(batch) >= min(2, batch_size):
            unplaced += len(short)
            short = batch
        else:
            unplaced += len(batch)
        rows, used = [], np.empty(0, dtype=hashes.dtype)
        deferred = offer(deferred)
    if len(short):
        batches.append(short)
    return (*_flat(batches), unplaced)


def _flat(batches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, bounds)`` of a list of index arrays (see :func:`build_batches_flat`)."""
    bounds = np.zeros(len(batches) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in batches], out=bounds[1:])
    rows = np.concatenate(batches, dtype=np.int64) if batches else np.empty(0, dtype=np.int64)
    return rows, bounds


def build_batches_row_by_row(
    hashes: np.ndarray, batch_size: int, drop_last: bool, seed: int
) -> tuple[list[list[int]], int]:
    """The definition :func:`build_batches` implements, one row at a time in Python (slow; for tests
    and ``scripts/bench_packing.py``): same permutation, same FIFO of deferred rows, same end of epoch.
    A row joins the batch being filled unless it shares a text with a row already in it."""
    order = np.random.default_rng(seed).permutation(hashes.shape[0]).tolist()
    texts = [set(row) for row in hashes.tolist()]
    batches: list[list[int]] = []
    deferred: list[int] = []

    def fill(candidates: list[int]) -> tuple[list[int], list[int]]:
        batch, seen, left = [], set(), []
        for i in candidates:
            if len(batch) < batch_size and seen.isdisjoint(texts[i]):
                batch.append(i)
                seen |= texts[i]
            else:
                left.append(i)
        return batch, left

    pos = 0
    while True:
        batch, left = fill(deferred)
        seen = set().union(*(texts[i] for i in batch))
        while len(batch) < batch_size and pos < len(order):
            i = order[pos]
            pos += 1
            if seen.isdisjoint(texts[i]):
                batch.append(i)
                seen |= texts[i]
            else:
                left.append(i)
        deferred = left
        if len(batch) < batch_size:
            break
        batches.append(batch)
    if drop_last:
        return batches, len(batch) + len(deferred)
    short: list[int] = []
    unplaced = 0
    while batch or deferred:
        if len(batch) == batch_size:
            batches.append(batch)
        elif len(batch) > len(short) and len(batch) >= min(2, batch_size):  # the largest short batch
            unplaced += len(short)
            short = batch
        else:
            unplaced += len(batch)
        batch, deferred = fill(deferred)
    if short:
        batches.append(short)
    return batches, unplaced


class NoDuplicatesSampler(DefaultBatchSampler):
    """Drop-in for sentence-transformers' ``NoDuplicatesBatchSampler`` with an exact ``__len__``.

    Pass the class as ``batch_sampler`` in the training arguments; the trainer constructs it with
    ``(dataset, batch_size, drop_last, valid_label_columns, generator, seed)`` and calls
    :meth:`set_epoch` before each epoch.

    ``batch_size`` is the per-device batch. ``world_size`` (default: the initialized
    torch.distributed group's size, else 1) makes the duplicate-free unit the global batch of
    ``batch_size x world_size`` rows, yielded as ``world_size`` consecutive per-device slices (see
    the module docstring); with ``world_size > 1`` a short last global batch is always dropped.
    ``sources`` (a :class:`cembed.data.batching.mixture.SourceMix`): the dataset is several sources' rows, one
    after another; every global batch holds one source's rows, laid out by the mix's schedule.
    ``no_duplicates=False``: plain shuffled batches (no text compared).

    Memory per row, all numpy (no Python object per row): 8 B per compared column (the hashes, kept),
    4 B for the current epoch's batches (int32 row indices, one flat array plus one offset per batch;
    8 B from 2^31 rows). Building an epoch adds about 8 B/row of transient int64 arrays (the
    permutation, the built batches before the source schedule) plus one batch's working set. A pair
    corpus (2 columns) keeps 20 B/row. Per-device batches become lists one at a time in ``__iter__``.
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
        sources: SourceMix | None = None,
        no_duplicates: bool = True,
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
        # The role columns (not <role>_input_ids beside a text column, nor a prepared source's <role>_hash).
        self.columns = compared_columns(dataset, label_columns) if no_duplicates else []
        self.hashes = row_hashes(dataset, self.columns)
        # How texts were compared, for messages (row_hashes uses the token ids where they exist).
        token_ids = any(c + TOKEN_SUFFIX in dataset.column_names for c in self.columns)
        self.compared_as = "token ids, as the model sees them" if token_ids else "raw text"
        self.world_size = world_size or get_world_size()
        self.sources = sources if sources is not None else SourceMix(("data",), (len(dataset),))
        if sum(self.sources.sizes) != len(dataset):
            raise ValueError(f"sources hold {sum(self.sources.sizes)} rows, the dataset {len(dataset)}")
        self._cache: tuple[int, np.ndarray, np.ndarray, int] | None = None
        self._sizes: dict[int, list[int]] = {}  # epoch -> its global batches' sizes
        self._origin: dict[int, list[int]] = {}  # epoch -> its global batches' source indices

    def _build(self, epoch: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Each source's batches (seed + epoch + i x SOURCE_SEED_STRIDE) in the mix's schedule order,
        as ``(rows, bounds, unplaced)`` (see :func:`build_batches_flat`; ``rows`` int32 below 2^31
        rows); rows of batches the schedule leaves out (round_robin, weighted) count as unplaced.
        After epoch 0, as many global batches as epoch 0 has (:meth:`_to_first_length`)."""
        size, drop = self.batch_size * self.world_size, self.drop_last or self.world_size > 1
        pieces, order, unplaced = self._scheduled(size, drop, self.seed + epoch)
        if epoch > 0:
            if 0 not in self._sizes:
                self._build(0)
            pieces, order, unplaced = self._to_first_length(pieces, order, unplaced, epoch, size)
        dtype = np.int32 if len(self.hashes) < 2**31 else np.int64
        rows = np.concatenate(pieces, dtype=dtype) if pieces else np.empty(0, dtype=dtype)
        sizes = [len(p) for p in pieces]
        bounds = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(sizes, out=bounds[1:])
        self._sizes[epoch], self._origin[epoch] = sizes, order
        return rows, bounds, unplaced

    def _scheduled(self, size: int, drop: bool, seed: int) -> tuple[list[np.ndarray], list[int], int]:
        """One shuffle's global batches in the mix's schedule order: ``(batches, their source
        indices, rows left out)`` (:func:`plan_epoch`)."""
        plan = plan_epoch(self.hashes, self.sources, size, drop, seed)
        taken = [0] * len(plan.rows)
        pieces = []
        for i in plan.order:
            rows, bounds = plan.rows[i], plan.bounds[i]
            pieces.append(rows[bounds[taken[i]] : bounds[taken[i] + 1]])
            taken[i] += 1
        return pieces, list(plan.order), sum(plan.unused)

    def _to_first_length(
        self, pieces: list[np.ndarray], order: list[int], unplaced: int, epoch: int, size: int
    ) -> tuple[list[np.ndarray], list[int], int]:
        """Epoch ``epoch``'s batches cut or completed to epoch 0's count (see the module docstring):
        a longer epoch keeps its first ones; a shorter one gets full batches of further shuffles
        (seed + epoch + k x :data:`REFILL_SEED_STRIDE`, k = 1, 2, ...) before its short last batch,
        if it has one. A further shuffle without a full batch ends the completion (the data has none)."""
        target = len(self._sizes[0])
        if len(pieces) == target:
            return pieces, order, unplaced
        if len(pieces) > target:
            pieces, order = pieces[:target], order[:target]
        else:
            tail = [(pieces.pop(), order.pop())] if pieces and len(pieces[-1]) < size else []
            k = 0
            while len(pieces) + len(tail) < target:
                k += 1
                more, sources, _ = self._scheduled(size, True, self.seed + epoch + k * REFILL_SEED_STRIDE)
                if not more:
                    break
                need = target - len(pieces) - len(tail)
                pieces, order = pieces + more[:need], order + sources[:need]
            for piece, source in tail:
                pieces.append(piece)
                order.append(source)
        used = np.unique(np.concatenate(pieces)) if pieces else np.empty(0, dtype=np.int64)
        return pieces, order, len(self.hashes) - len(used)

    def _epoch_batches(self) -> tuple[np.ndarray, np.ndarray, int]:
        """This epoch's ``(rows, bounds, unplaced)``, built once per epoch."""
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (self.epoch, *self._build(self.epoch))
        return self._cache[1], self._cache[2], self._cache[3]

    def rows_trained(self, steps: int, accumulation: int = 1) -> int:
        """Rows (over all ranks) in the global batches the first ``steps`` optimizer steps trained on,
        epoch after epoch, each step taking ``accumulation`` batches and an epoch's last step the
        batches left (short batches counted as they are)."""
        return sum(rows for _, rows in self.trained_per_source(steps, accumulation))

    def trained_per_source(self, steps: int, accumulation: int = 1) -> list[tuple[int, int]]:
        """``(global batches, rows)`` per source (in :attr:`sources` order) that the first ``steps``
        optimizer steps trained on (see :meth:`rows_trained`)."""
        counts = [[0, 0] for _ in self.sources.names]
        epoch = 0
        while steps > 0:
            if epoch not in self._sizes:
                self._build(epoch)
            sizes, origin = self._sizes[epoch], self._origin[epoch]
            per_epoch = -(-len(sizes) // accumulation)
            if per_epoch == 0:
                break
            take = min(steps, per_epoch)
            for size, i in zip(sizes[: take * accumulation], origin):
                counts[i][0] += 1
                counts[i][1] += size
            steps, epoch = steps - take, epoch + 1
        return [(b, r) for b, r in counts]

    def batch_sources(self, epoch: int | None = None) -> list[int]:
        """The global batches' source indices of ``epoch`` (None: the current one), in order; an
        epoch other than the current one is built for it (its batches are not kept)."""
        if epoch is None or epoch == self.epoch:
            self._epoch_batches()
            return self._origin[self.epoch]
        if epoch not in self._origin:
            self._build(epoch)
        return self._origin[epoch]

    def global_batches(self) -> list[list[int]]:
        """This epoch's duplicate-free global batches (``batch_size x world_size`` row indices each)."""
        rows, bounds, _ = self._epoch_batches()
        return [rows[a:b].tolist() for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]

    @property
    def unplaced(self) -> int:
        """Rows not used this epoch (see :func:`build_batches`)."""
        return self._epoch_batches()[2]

    def __iter__(self):
        # Lists are made one per-device batch at a time, as the DataLoader asks for them.
        rows, bounds, _ = self._epoch_batches()
        size = self.batch_size
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            if self.world_size == 1:
                yield rows[a:b].tolist()
            else:
                for rank in range(self.world_size):
                    yield rows[min(a + rank * size, b) : min(a + (rank + 1) * size, b)].tolist()

    def __len__(self) -> int:
        """Per-device batches yielded this epoch: ``world_size x`` the number of global batches."""
        return (len(self._epoch_batches()[1]) - 1) * self.world_size
