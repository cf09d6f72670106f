"""scripts/bench_window.py's counting: shared-text pairs per batch, and the streaming shuffle order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import load_script

REPO = Path(__file__).resolve().parents[2]


def bench():
    return load_script(REPO / "scripts" / "bench_window.py", "bench_window")


def test_shared_pairs_counts_row_pairs_per_text_across_columns():
    b = bench()
    # Rows: (1, 2), (2, 3), (4, 2), (5, 5), (6, 7). Text 2 in three rows (one as anchor): 3 pairs;
    # text 5 twice inside one row: no pair. Batch [3, 4]: none.
    h = np.array([[1, 2], [2, 3], [4, 2], [5, 5], [6, 7]], dtype=np.uint64)
    pairs = b.shared_pairs(h, [np.array([0, 1, 2, 3]), np.array([3, 4]), np.array([0, 1])])
    assert pairs.tolist() == [3, 0, 1]


def test_buffer_shuffled_is_a_permutation_that_stays_local():
    b = bench()
    order = b.buffer_shuffled(25_000, 1_000, seed=0)
    assert sorted(order.tolist()) == list(range(25_000))
    assert not np.array_equal(order, np.arange(25_000))
    # The first 500 rows read are from the first 1,000 of the file (half a buffer yielded at a time).
    assert order[:500].max() < 1_000
