"""Row hashes and sampler state (issue 24 item 3): equal texts hash equal, different ones differ,
computed record batch by record batch, and the sampler keeps numpy arrays, no Python object per row."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pyarrow as pa
from datasets import Dataset

from cembed.data import identity
from cembed.data.identity import hash_texts, hash_token_ids, row_hashes


def _lists(rows: list[list[int]]) -> pa.ListArray:
    return pa.array(rows, type=pa.list_(pa.int32()))


def test_token_hash_equal_for_equal_sequences_and_differs_otherwise():
    rows = [[5, 6, 7], [5, 6, 7], [7, 6, 5], [5, 6], [5, 6, 7, 0], [], [0], [6, 5, 7], [1 << 20, 3]]
    h = hash_token_ids(_lists(rows))
    assert h.dtype == np.uint64 and h.shape == (len(rows),)
    assert h[0] == h[1]  # same ids
    assert len(set(h[1:].tolist())) == len(rows) - 1  # order, length, an appended 0, empty: all differ


def test_token_hash_skips_each_rows_prompt():
    # A prompt's tokens (2 in row 0, 3 in row 1, none in row 2) are not the text: the three rows are one text.
    h = hash_token_ids(_lists([[90, 91, 1, 2], [80, 81, 82, 1, 2], [1, 2], [1, 2, 3]]), np.array([2, 3, 0, 0]))
    assert h[0] == h[1] == h[2] != h[3]
    assert hash_token_ids(_lists([[9, 1, 2], [1, 2]]), 1)[0] == hash_token_ids(_lists([[1, 2]]))[0]
    # A skip past the row's end leaves an empty text.
    assert hash_token_ids(_lists([[1, 2]]), 5)[0] == hash_token_ids(_lists([[]]))[0]


def test_token_hash_same_over_chunks_slices_and_token_budget(monkeypatch):
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 50, rng.integers(0, 9)).tolist() for _ in range(500)]
    whole = hash_token_ids(_lists(rows))
    sliced = pa.chunked_array([_lists(rows[:10]), _lists([[1]] + rows[10:]).slice(1)])  # a chunk with an offset
    monkeypatch.setattr(identity, "_SLICE_TOKENS", 7)  # many slices per chunk
    assert hash_token_ids(sliced).tolist() == whole.tolist()
    equal = [tuple(a) == tuple(b) for a in rows[:60] for b in rows[:60]]
    same = [x == y for x in whole[:60] for y in whole[:60]]
    assert same == equal


def test_no_collision_among_many_distinct_sequences():
    rng = np.random.default_rng(1)
    n = 100_000
    lengths = rng.integers(1, 6, n)
    ids = rng.integers(0, 8, lengths.sum())  # a small vocabulary: many near-identical rows
    arr = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)), pa.array(ids))
    distinct = len({tuple(r) for r in arr.to_pylist()})
    assert len(np.unique(hash_token_ids(arr))) == distinct


def test_text_hash_of_an_arrow_column_is_the_lists():
    texts = ["a", None, "b", "a", ""]
    col = pa.chunked_array([pa.array(texts[:2]), pa.array(texts[2:])])
    assert hash_texts(col).tolist() == hash_texts(texts).tolist()
    assert hash_texts(col)[1] == hash_texts(col)[4]  # a null is no text


def test_row_hashes_heap_is_bounded_per_row(monkeypatch):
    # 200k pre-tokenized rows (2 columns, ~40 ids each, a per-row prompt length): the hashes
    # themselves are 16 B/row; the old per-row loop held ~850 B/row of Python objects and int64 copies.
    n, k = 200_000, 40
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    ids = pa.ListArray.from_arrays(
        offsets, pa.array(np.random.default_rng(0).integers(0, 30000, n * k, dtype=np.int32))
    )
    ds = Dataset(
        pa.table(
            {
                "anchor": pa.array(np.full(n, "q")),
                "positive": pa.array(np.full(n, "p")),
                "anchor_input_ids": ids,
                "positive_input_ids": ids,
                "anchor_prompt_length": pa.array(np.full(n, 2, dtype=np.int64)),
            }
        )
    )
    monkeypatch.setattr(
        identity, "_SLICE_TOKENS", 1 << 16, raising=False
    )  # a slice's temporaries: a few MB, not per row
    tracemalloc.start()
    try:
        h = row_hashes(ds, ["anchor", "positive"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert h.shape == (n, 2) and h[0, 0] != h[0, 1]  # one id list, the anchor's without its 2 prompt tokens
    assert peak / n < 120, f"{peak / n:.0f} B/row"


def test_sampler_keeps_numpy_state_per_row():
    # 100k rows, 2 compared columns: hashes 16 B/row + this epoch's batches as int32 4 B/row. The old
    # sampler kept each epoch as lists of Python ints (~56 B/row in all).
    from cembed.data.batching.full_table import NoDuplicatesSampler

    n = 100_000
    ds = Dataset(
        pa.table({"anchor": pa.array([f"q{i}" for i in range(n)]), "positive": pa.array([f"p{i}" for i in range(n)])})
    )
    tracemalloc.start()
    try:
        s = NoDuplicatesSampler(ds, batch_size=1000, drop_last=False, seed=0, world_size=2)
        assert len(s) == 100  # 50 global batches of 2000 rows, 2 per-device slices each
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept / n < 24, f"{kept / n:.0f} B/row"
    batches = list(s)
    assert all(isinstance(b, list) and len(b) == 1000 for b in batches)
    glob = s.global_batches()
    assert [r for b in glob for r in b] == [r for b in batches for r in b]
    assert sorted(r for b in batches for r in b) == list(range(n))
