"""The windowed batcher's edges, one behavior each (written against `make mutate`'s survivors): which
rows pop_dropped hands back and when, the end of the stream (deferred rows packed into full batches,
the largest short batch kept, the rows left counted), a push after finish, and windowed_batches
passing its arguments through."""

from __future__ import annotations

import numpy as np
import pytest

from cembed.data.batching.windowed import WindowCounts, WindowedBatcher, windowed_batches


def _h(rows: list[tuple[int, ...]]) -> np.ndarray:
    """Rows of text ids (one per column) as the batcher's uint64 hashes."""
    return np.array(rows, dtype=np.uint64)


def test_the_buffer_bound_drops_the_oldest_deferred_row_as_soon_as_it_is_one_over():
    # B = 2, W = 1: at most 2 rows wait. r0 is taken, r1 r2 wait, r3 makes three: r1 (the oldest) goes.
    batcher = WindowedBatcher(2, 1)
    assert batcher.push(_h([(7,)] * 4)) == []
    dropped = batcher.pop_dropped()
    assert dropped.tolist() == [1] and dropped.dtype == np.int64
    assert batcher.counts == WindowCounts(rows_read=4, dropped=1, deferred=3, buffered=3)
    assert batcher.pop_dropped().tolist() == []  # handed back once


def test_a_row_past_its_window_is_handed_back_when_its_last_batch_closes():
    # Rows ab ac ad ef gh ...: ad waits one batch (W = 1), is refused again and dropped when batch 2 closes.
    batcher = WindowedBatcher(3, 1)
    texts = ["ab", "ac", "ad", "ef", "gh", "ij", "ck", "lm"]
    batches = batcher.push(_h([(ord(a), ord(p)) for a, p in texts]))
    assert [b.tolist() for b in batches] == [[0, 3, 4], [1, 5, 7]]
    assert batcher.pop_dropped().tolist() == [2]
    empty = WindowedBatcher(3, 1).pop_dropped()
    assert empty.tolist() == [] and empty.dtype == np.int64


def test_the_end_packs_deferred_rows_into_a_full_batch():
    # B = 2: r0 (1, 2) alone in the last batch (left: drop_last), r1 (1, 3) and r2 (2, 4) were refused
    # by it; at the end they fill a batch together.
    batcher = WindowedBatcher(2, 2)
    assert batcher.push(_h([(1, 2), (1, 3), (2, 4)])) == []
    assert [b.tolist() for b in batcher.finish()] == [[1, 2]]
    assert batcher.counts == WindowCounts(rows_read=3, batches=1, placed=2, deferred=2, left_at_end=1)


def test_without_drop_last_the_first_of_equally_short_batches_is_kept():
    # B = 3: the end's batches are [0, 1] and then [2, 3] (refused by it): the same size, the first stays.
    batcher = WindowedBatcher(3, 2, drop_last=False)
    assert batcher.push(_h([(1, 2), (3, 4), (1, 5), (3, 6)])) == []
    assert [b.tolist() for b in batcher.finish()] == [[0, 1]]
    assert batcher.counts.left_at_end == 2 and batcher.counts.placed == 2


def test_without_drop_last_rows_left_before_the_kept_batch_still_count():
    # B = 3: the end's batches: [0] (1 row: never kept), [1, 3] (kept), [2] (1 row): 2 rows left.
    batcher = WindowedBatcher(3, 2, drop_last=False)
    assert batcher.push(_h([(1, 2), (1, 3), (1, 4), (2, 5)])) == []
    assert [b.tolist() for b in batcher.finish()] == [[1, 3]]
    assert batcher.counts == WindowCounts(rows_read=4, batches=1, placed=2, deferred=3, left_at_end=2)


def test_after_finish_a_push_is_refused_and_finish_returns_nothing_more():
    batcher = WindowedBatcher(2, 1)
    batcher.push(_h([(1, 2), (3, 4), (5, 6)]))
    assert batcher.finish() == []  # the last row alone: dropped under drop_last
    assert batcher.finish() == []
    with pytest.raises(ValueError, match="^push after finish: the stream has ended$"):
        batcher.push(_h([(7, 8)]))


HAND = ["ab", "ac", "ad", "ef", "gh", "ij", "ck", "lm", "no", "pq"]  # as in test_windowed.py


def _chunks():
    h = _h([(ord(a), ord(p)) for a, p in HAND])
    return [(h[i : i + 4], HAND[i : i + 4]) for i in range(0, 10, 4)]


def test_windowed_batches_passes_window_and_drop_last_to_the_batcher():
    # W = 0 drops refused rows at once; the end's [no, pq] is a short batch, kept only without drop_last.
    assert list(windowed_batches(_chunks(), 3, 0)) == [["ab", "ef", "gh"], ["ij", "ck", "lm"]]
    assert list(windowed_batches(_chunks(), 3, 0, drop_last=True)) == [["ab", "ef", "gh"], ["ij", "ck", "lm"]]
    assert list(windowed_batches(_chunks(), 3, 0, drop_last=False))[-1] == ["no", "pq"]
    # W = 2: ad waits two batches and joins the third (with W = 1 it is dropped).
    assert list(windowed_batches(_chunks(), 3, 2))[-1] == ["ad", "ck", "no"]


def test_windowed_batches_yields_the_ends_batches_as_payloads():
    chunks = [(_h([(1, 2), (1, 3), (2, 4)]), ["r0", "r1", "r2"])]
    assert list(windowed_batches(chunks, 2, 2)) == [["r1", "r2"]]


def test_a_chunk_of_more_hashes_than_payloads_is_refused():
    with pytest.raises(ValueError, match="^a chunk has 2 rows of hashes and 1 payloads$"):
        list(windowed_batches([(_h([(1, 2), (3, 4)]), ["r0"])], 2, 1))


def test_a_batch_of_one_row_and_the_default_drop_last():
    assert [b.tolist() for b in WindowedBatcher(1, 0).push(_h([(1, 2), (3, 4)]))] == [[0], [1]]
    batcher = WindowedBatcher(3, 1)  # drop_last by default: the end's [3, 4] is dropped
    assert [b.tolist() for b in batcher.push(_h([(1, 2), (3, 4), (5, 6), (7, 8), (9, 10)]))] == [[0, 1, 2]]
    assert batcher.finish() == [] and batcher.counts.left_at_end == 2


def test_hashes_that_differ_only_in_their_low_bits_are_different_texts():
    # 64-bit hashes as given (a list, or int64 as pyarrow hands them over) are compared as uint64: as
    # floats, 2**62 + 1 ... 2**62 + 11 would all be one text. r1 waits for batch 2 (it shares 2**62 + 1).
    big = 2**62
    rows = [[big + 1, big + 3], [big + 1, big + 5], [big + 7, big + 9], [big + 6, big + 11]]
    for hashes in (rows, np.array(rows, dtype=np.int64), _h(rows)):
        assert [b.tolist() for b in WindowedBatcher(2, 1).push(hashes)] == [[0, 2], [1, 3]]


def test_hashes_of_one_dimension_are_refused():
    with pytest.raises(ValueError, match=r"^hashes must be \(rows, columns\), got shape \(3,\)$"):
        WindowedBatcher(2, 1).push(np.zeros(3, dtype=np.uint64))
