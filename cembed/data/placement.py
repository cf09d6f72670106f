"""Where rows go: the rows the no-duplicates sampler cannot place, and ``cembed inspect-data``'s report.

A row whose text (in any column) is shared by many rows can join at most one of them per batch, so
at a large batch some rows are never trained on in an epoch (a popular hard negative in half the
rows leaves half the rows out). :func:`find_unplaceable` runs the sampler's first epoch and, when
rows go unused beyond the short last batch, says how many and why (the column and text that repeat);
``validate`` and the start of ``train`` show it as a plan warning, ``inspect-data`` in its table.

``inspect-data`` compares texts as the model sees them when the config's model can be loaded (the
token ids after truncation, as the sampler does with pre-tokenized data), else as raw text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cembed.data.prepare import PreparedData, arrow_table, source_views
from cembed.data.sampler import SOURCE_SEED_STRIDE, build_batches, fits, row_hashes
from cembed.errors import UserError, first_line


@dataclass(frozen=True)
class Unplaceable:
    """Rows the sampler leaves unused in an epoch beyond a short last batch, and the main reason."""

    rows: int  # rows unused in epoch 0
    total: int  # rows in the data
    batch_size: int  # global batch
    batches: int  # batches built in epoch 0
    role: str  # role column of the most repeated text among the unused rows
    column: str  # its source column
    text: str  # that text
    holders: int  # rows holding it (in any column)

    def __str__(self) -> str:
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return (
            f"{self.rows} of {self.total} rows cannot be placed in a duplicate-free batch of {self.batch_size} "
            f"({self.batches} batches per epoch) and are not trained on: their texts repeat across rows, most of "
            f"all column {self.column!r} (role {self.role}): {text!r} is in {self.holders} rows and a batch holds "
            "it at most once; deduplicate that column, lower batch.per_device_train_batch_size or set "
            "sampler.no_duplicates: false"
        )


def find_unplaceable(
    data: PreparedData, batch_size: int, drop_last: bool, seed: int, hashes: np.ndarray | None = None
) -> Unplaceable | None:
    """The rows the no-duplicates sampler leaves unused in epoch 0 (``seed``) beyond the
    ``rows % batch_size`` a short last batch leaves with ``drop_last`` (None: no such rows).

    Args:
        data: the prepared training data.
        batch_size: the global batch (per device x world size).
        drop_last: ``batch.drop_last`` (forced on with more than one process).
        seed: the sampler's seed (``train.seed``).
        hashes: the rows' text hashes (default: :func:`cembed.data.sampler.row_hashes` of the raw texts).
    """
    hashes = row_hashes(data.dataset, data.columns) if hashes is None else hashes
    n = hashes.shape[0]
    if n == 0 or hashes.shape[1] == 0:
        return None
    batches, unplaced = build_batches(hashes, batch_size, drop_last, seed)
    if unplaced <= (n % batch_size if drop_last else 0):
        return None
    unused = np.ones(n, dtype=bool)
    unused[np.concatenate([np.asarray(b, dtype=np.int64) for b in batches]) if batches else []] = False
    # Rows holding each text (a text repeated inside one row counts once).
    srt = np.sort(hashes, axis=1)
    distinct = np.ones_like(srt, dtype=bool)
    distinct[:, 1:] = srt[:, 1:] != srt[:, :-1]
    uniq, counts = np.unique(srt[distinct], return_counts=True)
    holders = counts[np.searchsorted(uniq, hashes)]  # (rows, columns)
    rows = np.flatnonzero(unused)
    flat = int(np.argmax(holders[rows]))
    row, j = int(rows[flat // hashes.shape[1]]), flat % hashes.shape[1]
    role = data.columns[j]
    text = str(arrow_table(data.dataset).column(role)[row].as_py())
    return Unplaceable(
        unplaced, n, batch_size, len(batches), role, data.roles.get(role, role), text, int(holders[row, j])
    )


def unplaceable_warnings(plan, data, drop_last: bool, seed: int) -> tuple[str, ...]:
    """:func:`find_unplaceable`'s report for each training source under ``plan``'s batch, as warnings
    (printed by ``validate`` and at the start of ``train``, beside the plan's own); empty when every
    row can be placed or ``data`` has no rows loaded (:class:`cembed.data.prepare.UnloadedData`)."""
    if not hasattr(data, "dataset"):
        return ()
    batch = plan.per_device_train_batch_size * plan.world_size
    drop = drop_last or plan.world_size > 1
    views = source_views(data)  # source i is shuffled as the sampler shuffles it
    found = [find_unplaceable(view, batch, drop, seed + i * SOURCE_SEED_STRIDE) for i, view in enumerate(views)]
    return tuple(str(f) for f in found if f)


def model_hashes(data: PreparedData, model_cfg, cache_dir: str | None = None) -> tuple[np.ndarray, str]:
    """The rows' text hashes as the model sees them: token ids after truncation, with the model's
    tokenizer (loaded on CPU; tokenized once, cached like training's), and a note saying so; raw
    text, and why, when the model cannot be loaded."""
    from cembed.data.tokenize import pretokenize
    from cembed.model.load import load_model, quiet_libraries

    quiet_libraries()
    try:
        model = load_model(model_cfg, "cpu", for_training=False)
    except UserError as err:
        return row_hashes(data.dataset, data.columns), f"raw text (model not loaded: {first_line(err, 120)})"
    length = int(model.max_seq_length)
    if getattr(model, "tokenizer", None) is None:
        return row_hashes(data.dataset, data.columns), "raw text (the model has no tokenizer)"
    tokenized = pretokenize(data.dataset, data.columns, model.tokenizer, length, cache_dir).dataset
    return row_hashes(tokenized, data.columns), f"token ids ({model_cfg.name_or_path}, max_seq_length {length})"


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
    data: PreparedData, batch_size: int, drop_last: bool, seed: int, model_cfg=None, cache_dir: str | None = None
) -> list[DataReport]:
    """Per training source: distinct texts per column and how the no-duplicates sampler batches
    its rows at ``batch_size`` rows (epoch 0, each source shuffled as the sampler shuffles it; every
    batch holds one source's rows), comparing texts as ``model_cfg``'s model sees them
    (:func:`model_hashes`, tokenized into ``cache_dir``; raw text without a model), with the rows
    that cannot be placed."""
    import pyarrow.compute as pc

    if model_cfg is None:
        all_hashes, compared = row_hashes(data.dataset, data.columns), "raw text"
    else:
        all_hashes, compared = model_hashes(data, model_cfg, cache_dir)
    reports = []
    for i, (view, src) in enumerate(zip(source_views(data), data.sources or [None])):
        offset, source_seed = (src.offset if src is not None else 0), seed + i * SOURCE_SEED_STRIDE
        hashes = all_hashes[offset : offset + len(view.dataset)]
        table = arrow_table(view.dataset)
        distinct = {role: (view.roles[role], pc.count_distinct(table.column(role)).as_py()) for role in view.columns}
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
    batches, unplaced = build_batches(hashes, batch_size=batch_size, drop_last=drop_last, seed=seed)
    upper = min((len(np.unique(hashes[:, j])) for j in range(hashes.shape[1])), default=n) if n else 0
    return {
        "colliding_share": float(colliding_rows(hashes).mean()) if n else 0.0,
        "largest_batch": max([greedy] + [len(b) for b in batches]),
        "largest_batch_upper_bound": upper,
        "batches_per_epoch": len(batches),
        "rows_unplaced": unplaced,
    }
