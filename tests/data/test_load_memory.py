"""Cell checks and distinct counts slice by slice (issue 24 item 3): same messages and rows, with
arrow memory bounded by a slice, not by the column."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from datasets import Dataset

from cembed.data import batchable, load
from cembed.data.batchable import check_batchable
from cembed.data.load import check_cells
from cembed.data.rows import TrainingData
from cembed.errors import UserError

ROLES = {"anchor": "question", "positive": "answer"}


def _ds(n: int, width: int = 1) -> Dataset:
    pad = "x" * width
    return Dataset(
        pa.table(
            {
                "anchor": pa.array([f"q{i} {pad}" for i in range(n)]),
                "positive": pa.array([f"p{i} {pad}" for i in range(n)]),
            }
        )
    )


def _bad(ds: Dataset, cells: dict[tuple[str, int], str | None]) -> Dataset:
    rows = ds.to_dict()
    for (col, i), value in cells.items():
        rows[col][i] = value
    return Dataset.from_dict(rows)


def test_first_bad_cell_over_slices_and_columns(monkeypatch):
    monkeypatch.setattr(load, "CHECK_ROWS", 7)  # many slices
    ds = _bad(_ds(50), {("anchor", 40): "  ", ("positive", 23): None, ("positive", 45): "ok", ("anchor", 30): ""})
    with pytest.raises(UserError) as err:
        check_cells(ds, "pairs.jsonl", ROLES, False, lambda i: f"line {i + 1}")
    assert str(err.value) == (
        "pairs.jsonl: line 24: column 'answer' (role positive) is empty (null/NaN); fix the data or set "
        "data.drop_invalid_rows: true to skip such rows"
    )
    kept, dropped = check_cells(ds, "pairs.jsonl", ROLES, True)
    assert dropped == 3 and len(kept) == 47
    assert "q40 x" not in kept["anchor"] and "q30 x" not in kept["anchor"] and "q23 x" not in kept["anchor"]


def _arrow_peak(fn) -> int:
    """Peak bytes the arrow default pool holds while ``fn`` runs (a fresh proxy pool's own peak)."""
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    old = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        fn()
    finally:
        pa.set_memory_pool(old)
    return pool.max_memory()


def test_cell_checks_and_distinct_count_do_not_copy_the_column(monkeypatch):
    # 400k rows of ~100-byte texts: the old checks held a trimmed copy of each whole column (cell
    # checks) and a hash table of every distinct text (distinct count): >100 B/row of arrow memory.
    # Slices of 4,096 rows: a slice's temporaries (~1-2 MB) are well under the bound.
    monkeypatch.setattr(load, "CHECK_ROWS", 4096, raising=False)
    monkeypatch.setattr(batchable, "CHECK_ROWS", 4096, raising=False)  # its distinct count slices too
    n = 400_000
    ds = _ds(n, 100)
    peak = _arrow_peak(lambda: check_cells(ds, "pairs", ROLES, False))
    assert peak / n < 10, f"cell checks: {peak / n:.0f} B/row"
    data = TrainingData(ds, "pairs", n, roles=ROLES)
    peak = _arrow_peak(lambda: check_batchable(data, 1024, True))
    assert peak / n < 10, f"distinct count: {peak / n:.0f} B/row"


def test_distinct_count_stops_once_a_batch_is_reached():
    col = pa.chunked_array([pa.array(["a", "b", None, "a"] * 100_000)])
    assert batchable.distinct_at_least(col, 10) == 2
    many = pa.chunked_array([pa.array(np.arange(300_000).astype(str))])
    assert 5 <= batchable.distinct_at_least(many, 5) <= batchable.CHECK_ROWS
    assert batchable.distinct_at_least(many, 10**9) == 300_000
