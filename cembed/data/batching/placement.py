"""Where rows go: the rows the no-duplicates sampler cannot place, and ``cembed inspect-data``'s report.

A row whose text (in any column) is shared by many rows can join at most one of them per batch, so
at a large batch some rows are never trained on in an epoch (a popular hard negative in half the
rows leaves half the rows out). :func:`find_unplaceable` runs the sampler's first epoch and, when
rows go unused beyond the short last batch, says how many and why (the column and text that repeat);
``validate`` and the start of ``train`` show it as a plan warning, ``inspect-data`` in its table.

``validate`` and ``inspect-data`` compare texts exactly as the training sampler will
(:func:`sampler_hashes`): the data tokenized as training tokenizes it (same prompts, same
``data.pretokenize``, same fallback) and hashed by :func:`cembed.data.identity.row_hashes`, so token
ids after truncation when training pre-tokenizes, raw text when it does not or the model cannot be
loaded. Data the sampler cannot fill one batch from is refused there, naming the column
(:func:`no_batch_reason`), as ``train`` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cembed.data.batching.fits import fits
from cembed.data.batching.full_table import SOURCE_SEED_STRIDE, build_batches_flat, plan_epoch
from cembed.data.batching.mixture import SourceMix
from cembed.data.identity import arrow_table, row_hashes
from cembed.data.prompts import training_prompts
from cembed.data.rows import TrainingData, source_views
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
    data: TrainingData, batch_size: int, drop_last: bool, seed: int, hashes: np.ndarray | None = None
) -> Unplaceable | None:
    """The rows the no-duplicates sampler leaves unused in epoch 0 (``seed``) beyond the
    ``rows % batch_size`` a short last batch leaves with ``drop_last`` (or a lone last row without
    it) (None: no such rows).

    Args:
        data: the prepared training data.
        batch_size: the global batch (per device x world size).
        drop_last: ``batch.drop_last`` (forced on with more than one process).
        seed: the sampler's seed (``train.seed``).
        hashes: the rows' text hashes (default: :func:`cembed.data.identity.row_hashes` of the raw texts).
    """
    hashes = row_hashes(data.dataset, data.columns) if hashes is None else hashes
    n = hashes.shape[0]
    if n == 0 or hashes.shape[1] == 0:
        return None
    placed, bounds, unplaced = build_batches_flat(hashes, batch_size, drop_last, seed)
    # What the end of an epoch leaves out whatever the texts: the short last batch with drop_last, and
    # without it a lone last row (a 1-row batch has no in-batch negative, build_batches_flat drops it).
    remainder = n % batch_size
    if unplaced <= (remainder if drop_last or remainder == 1 else 0):
        return None
    unused = np.ones(n, dtype=bool)
    unused[placed] = False
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
    table = arrow_table(data.dataset)
    if role in table.column_names:
        text = str(table.column(role)[row].as_py())
    else:  # a prepared source holds token ids only
        text = f"(row {row + 1}; a prepared source stores token ids, not text)"
    return Unplaceable(
        unplaced, n, batch_size, len(bounds) - 1, role, data.roles.get(role, role), text, int(holders[row, j])
    )


def unplaceable_warnings(plan, data, drop_last: bool, seed: int, hashes: np.ndarray | None = None) -> tuple[str, ...]:
    """:func:`find_unplaceable`'s report for each training source under ``plan``'s batch, as warnings
    (printed by ``validate`` and at the start of ``train``, beside the plan's own); empty when every
    row can be placed or ``data`` has no rows loaded (:class:`cembed.data.rows.UnloadedData`).
    ``hashes``: all rows' hashes, shape ``(rows, columns)`` (:func:`sampler_hashes`; default: raw text)."""
    if not hasattr(data, "dataset"):
        return ()
    batch = plan.per_device_train_batch_size * plan.world_size
    drop = drop_last or plan.world_size > 1
    found = []
    for i, (view, offset) in enumerate(_views_with_offsets(data)):  # source i shuffled as the sampler does
        part = None if hashes is None else hashes[offset : offset + len(view.dataset)]
        found.append(find_unplaceable(view, batch, drop, seed + i * SOURCE_SEED_STRIDE, part))
    return tuple(str(f) for f in found if f)


def schedule_warnings(
    plan, data, sampling, drop_last: bool, seed: int, hashes: np.ndarray | None = None
) -> tuple[str, ...]:
    """One warning per training source whose rows the ``data.sampling`` schedule leaves unused in an
    epoch (round_robin and weighted end the epoch when a source runs out of batches), with the
    share: the count is the sampler's own epoch 0 (:func:`cembed.data.batching.full_table.plan_epoch`,
    the plan :class:`~cembed.data.batching.full_table.NoDuplicatesSampler` trains on), all the rows
    of the source the epoch does not train on. Empty with one source, ``proportional`` (every batch
    of every source is taken) or no rows loaded.

    Args:
        plan: the resolved plan (its per-device batch and world size make the global batch).
        sampling: the ``data.sampling`` section (:class:`cembed.config.data.SamplingConfig`).
        hashes: all rows' hashes as the sampler compares them (:func:`sampler_hashes`; zero columns
            with ``sampler.no_duplicates: false``; default: raw text).
    """
    if not hasattr(data, "dataset") or len(data.sources) < 2:
        return ()
    mix = SourceMix.from_data(data, sampling)
    hashes = row_hashes(data.dataset, data.columns) if hashes is None else hashes
    batch = plan.per_device_train_batch_size * plan.world_size
    epoch = plan_epoch(hashes, mix, batch, drop_last or plan.world_size > 1, seed)
    taken, available = epoch.taken, [len(b) - 1 for b in epoch.bounds]
    if taken == available:
        return ()
    ran_out = ", ".join(data.sources[i].where for i in range(len(taken)) if taken[i] == available[i])
    out = []
    for src, unused, size, t, a in zip(data.sources, epoch.unused, epoch.sizes, taken, available):
        if t < a:
            out.append(
                f"{src.where}: {unused} of {size} rows ({round(100 * unused / size)}%) unused each epoch under "
                f"data.sampling.strategy {mix.strategy}: the schedule ends the epoch when {ran_out} has no batch "
                f"left, after {t} of this source's {a} batches; set data.sampling.strategy: proportional to "
                "train on every source's batches each epoch (each source's share of steps its share of rows)"
            )
    return tuple(out)


def _views_with_offsets(data: TrainingData) -> list[tuple[TrainingData, int]]:
    """Each source's view (:func:`cembed.data.rows.source_views`) and its first row in ``data``."""
    views = source_views(data)
    offsets = [src.offset for src in data.sources] if len(views) > 1 else [0]
    return list(zip(views, offsets))


def no_batch_reason(hashes: np.ndarray, columns: list[str], batch_size: int, compared: str = "raw text") -> str:
    """Why rows hashed as ``hashes`` (``(rows, columns)``, the sampler's) cannot fill one
    duplicate-free batch of ``batch_size``: the columns with fewer distinct texts than the batch, or
    else the column holding the text most rows share (a batch holds it once). ``columns`` name the
    hash columns (``"'answer' (role positive)"``), ``compared`` says how texts were compared."""
    n, k = hashes.shape
    few = [(columns[j], len(np.unique(hashes[:, j]))) for j in range(k)]
    few = [(c, d) for c, d in few if d < batch_size]
    if few:
        listed = ", ".join(f"column {c} has only {d} distinct texts" for c, d in few)
        return f"{listed} (compared as {compared}), so no duplicate-free batch of {batch_size} rows exists"
    if n == 0 or k == 0:
        return f"there are {n} rows"
    uniq, counts = np.unique(hashes, return_counts=True)
    top = uniq[np.argmax(counts)]
    where = [columns[j] for j in range(k) if (hashes[:, j] == top).any()]
    holders = int((hashes == top).any(axis=1).sum())
    return (
        f"one text of column {' and '.join(where)} is in {holders} rows (compared as {compared}) and texts "
        f"repeat across rows and columns, so no duplicate-free batch of {batch_size} rows can be built"
    )


def largest_filled_batch(hashes: np.ndarray, seed: int) -> int:
    """The largest batch (rows) the no-duplicates sampler fills at least once in an epoch shuffled
    with ``seed``: its first batch takes, in the seeded permutation's order, every row sharing no text
    with a row already taken (:func:`cembed.data.batching.full_table.build_batches`), so a batch of ``b`` rows is
    filled exactly when that first-fit pass over all ``hashes`` (``(rows, columns)``) takes ``b`` rows
    or more. 0 for no rows; every row when there are no text columns."""
    n = hashes.shape[0]
    if n == 0 or hashes.shape[1] == 0:
        return n
    order = np.random.default_rng(seed).permutation(n)
    return int(fits(hashes, order, np.empty(0, dtype=hashes.dtype), n).sum())


def largest_per_device_batch(data, hashes: np.ndarray, seed: int, world_size: int = 1) -> int:
    """The largest ``batch.per_device_train_batch_size`` with which the no-duplicates sampler fills
    at least one batch of every training source of ``data`` in epoch 0 (``seed``), rows hashed as
    the sampler hashes them (``hashes``, all rows, :func:`sampler_hashes`), over ``world_size``
    processes (a global batch is per device x world size). 0: not even one row per device."""
    largest = min(
        largest_filled_batch(hashes[offset : offset + len(view.dataset)], seed + i * SOURCE_SEED_STRIDE)
        for i, (view, offset) in enumerate(_views_with_offsets(data))
    )
    return largest // world_size


def check_sampler_batches(plan, data, drop_last: bool, seed: int, hashes: np.ndarray, compared: str) -> None:
    """Refuse what ``train`` would refuse: a source from which the no-duplicates sampler builds no
    batch of ``plan``'s global batch in epoch 0, with rows hashed as the sampler hashes them
    (:func:`sampler_hashes`).

    Raises:
        UserError: naming the source, the batch, the column(s) (:func:`no_batch_reason`) and the
            largest ``batch.per_device_train_batch_size`` that fills a batch
            (:func:`largest_per_device_batch`).
    """
    if not hasattr(data, "dataset"):
        return
    batch = plan.per_device_train_batch_size * plan.world_size
    drop = drop_last or plan.world_size > 1
    for i, (view, offset) in enumerate(_views_with_offsets(data)):
        part = hashes[offset : offset + len(view.dataset)]
        if part.shape[1] and len(build_batches_flat(part, batch, drop, seed + i * SOURCE_SEED_STRIDE)[1]) == 1:
            names = [f"{view.roles.get(c, c)!r} (role {c})" for c in view.columns]
            raise UserError(
                f"{view.source}: the no-duplicates sampler cannot fill a single batch of {batch} rows: "
                f"{no_batch_reason(part, names, batch, compared)}; "
                f"{smaller_batch_fix(largest_per_device_batch(data, hashes, seed, plan.world_size), plan.world_size)}"
                ", deduplicate that column or set sampler.no_duplicates: false"
            )


def smaller_batch_fix(largest: int, world_size: int = 1) -> str:
    """The fix a 0-batch refusal names: ``batch.per_device_train_batch_size`` lowered to ``largest``
    (:func:`largest_per_device_batch`), or why no size fills a batch."""
    processes = f" with {world_size} processes" if world_size > 1 else ""
    if largest < 1:
        return f"no batch.per_device_train_batch_size fills a batch{processes}"
    return (
        f"set batch.per_device_train_batch_size to {largest} or less (the largest that fills a batch{processes}; "
        "epoch 0 as the sampler shuffles it)"
    )


def sampler_hashes(data: TrainingData, model_cfg, data_cfg=None, model=None) -> tuple[np.ndarray, str, str | None]:
    """The rows' text hashes exactly as the training sampler will compute them, a note saying how
    texts were compared, and the tokenizing fallback's warning (None: none): the data tokenized as training tokenizes it
    (:func:`cembed.data.tokens.tokenize.tokenize_stage` with ``data_cfg``'s prompts, ``pretokenize`` and
    cache folder; the model loaded on CPU unless given) and hashed by
    :func:`cembed.data.identity.row_hashes` over ``data.columns``: token ids after truncation when
    training pre-tokenizes, raw text when it does not (the sampler then sees the texts) or when the
    model cannot be loaded (the note says why). ``data_cfg`` None: the ``data`` section's defaults.
    Shape ``(rows, len(data.columns))`` uint64."""
    from cembed.data.tokens.tokenize import tokenize_stage
    from cembed.model.load import load_model, quiet_libraries

    pretokenize, cache_dir, prompts_cfg, num_proc = (
        (True, None, None, None)
        if data_cfg is None
        else (data_cfg.pretokenize, data_cfg.cache_dir, data_cfg.prompts, data_cfg.num_proc)
    )
    quiet_libraries()
    try:
        model = model if model is not None else load_model(model_cfg, "cpu", for_training=False)
        prompts = training_prompts(data, model, prompts_cfg)
    except UserError as err:
        return row_hashes(data.dataset, data.columns), f"raw text (model not loaded: {first_line(err, 120)})", None
    if getattr(model, "tokenizer", None) is None:
        return row_hashes(data.dataset, data.columns), "raw text (the model has no tokenizer)", None
    dataset, _, info = tokenize_stage(
        model, data, pretokenize, cache_dir, prompts.columns, None, prompts.by_source, num_proc
    )
    if not info["pretokenized"]:
        compared = f"raw text, as the sampler compares them ({info['reason']})"
        return row_hashes(data.dataset, data.columns), compared, info.get("warning")
    from cembed.data.truncation import column_limits

    length = int(model.max_seq_length)
    cuts = "".join(f", {col} cut at {n}" for col, n in column_limits(model, data.columns).items())
    return (
        row_hashes(dataset, data.columns),
        f"token ids ({model_cfg.name_or_path}, max_seq_length {length}{cuts})",
        None,
    )
