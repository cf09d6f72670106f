"""``cembed inspect-data``'s back end: duplicates in the data and how the no-duplicates sampler will batch it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cembed.data.batching.fits import fits
from cembed.data.batching.full_table import SOURCE_SEED_STRIDE, build_batches_flat
from cembed.data.batching.placement import Unplaceable, find_unplaceable, sampler_hashes
from cembed.data.identity import row_hashes
from cembed.data.rows import TrainingData, source_views


@dataclass
class DataReport:
    """What ``cembed inspect-data`` reports: rows, distinct texts per role and batching."""

    source: str
    rows: int
    rows_dropped: int
    batch_size: int  # global batch (per device x world size)
    distinct: dict[str, tuple[str, int]]  # role column -> (source column, distinct texts)
    batching: dict  # :func:`inspect_batches` for batch_size
    compared_as: str = "raw text"  # how texts were compared (token ids when the model is known)
    unplaceable: Unplaceable | None = None


def inspect_data(
    data: TrainingData, batch_size: int, drop_last: bool, seed: int, model_cfg=None, data_cfg=None
) -> list[DataReport]:
    """Per training source: distinct texts per column and how the no-duplicates sampler batches
    its rows at ``batch_size`` rows (epoch 0, each source shuffled as the sampler shuffles it; every
    batch holds one source's rows), comparing texts as the training sampler will
    (:func:`sampler_hashes` with ``model_cfg`` and ``data_cfg``, the ``data`` section; raw text
    without a model), with the rows that cannot be placed. The distinct counts are of those hashes."""
    if model_cfg is None:
        all_hashes, compared = row_hashes(data.dataset, data.columns), "raw text"
    else:
        all_hashes, compared, _ = sampler_hashes(data, model_cfg, data_cfg)
    reports = []
    for i, (view, src) in enumerate(zip(source_views(data), data.sources or [None])):
        offset, source_seed = (src.offset if src is not None else 0), seed + i * SOURCE_SEED_STRIDE
        hashes = all_hashes[offset : offset + len(view.dataset)]
        distinct = {role: (view.roles[role], len(np.unique(hashes[:, j]))) for j, role in enumerate(view.columns)}
        batching = inspect_batches(hashes, batch_size, drop_last, source_seed)
        unplaceable = find_unplaceable(view, batch_size, drop_last, source_seed, hashes)
        reports.append(
            DataReport(
                view.source, len(view.dataset), view.rows_dropped, batch_size, distinct, batching, compared, unplaceable
            )
        )
    return reports


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
        ``colliding_share`` (rows sharing a text with another row), ``largest_batch`` (the size of
        a duplicate-free batch that exists, so a true lower bound of the largest: the larger of a
        maximal one found by first fit over the seeded permutation and the largest batch built at
        ``batch_size``), ``largest_batch_upper_bound`` (fewest distinct texts in any column),
        ``batches_per_epoch`` and ``rows_unplaced`` for ``batch_size`` (epoch 0, ``seed``).
    """
    n = hashes.shape[0]
    order = np.random.default_rng(seed).permutation(n)
    greedy = int(fits(hashes, order, np.empty(0, dtype=hashes.dtype), n).sum())
    _, bounds, unplaced = build_batches_flat(hashes, batch_size=batch_size, drop_last=drop_last, seed=seed)
    upper = min((len(np.unique(hashes[:, j])) for j in range(hashes.shape[1])), default=n) if n else 0
    return {
        "colliding_share": float(colliding_rows(hashes).mean()) if n else 0.0,
        "largest_batch": max(greedy, int(np.diff(bounds).max(initial=0))),
        "largest_batch_upper_bound": upper,
        "batches_per_epoch": len(bounds) - 1,
        "rows_unplaced": unplaced,
    }
