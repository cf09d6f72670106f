"""The windowed no-duplicates rule over a stream (cembed.data.batching.windowed)."""

from __future__ import annotations

import gzip
import json
import string

import numpy as np
import pytest

from cembed.data.batching.full_table import build_batches_flat
from cembed.data.batching.stream import StreamingRows, StreamingSource
from cembed.data.batching.windowed import WindowCounts, WindowedBatcher, windowed_batches
from cembed.data.identity import hash_token_ids


def reference(rows: list[list[int]], batch_size: int, window: int, drop_last: bool):
    """The window rule, one row at a time in Python (the definition the batcher implements):
    ``(batches as lists of row positions, dropped positions, rows left at the end)``."""
    texts = [set(r) for r in rows]
    batches: list[list[int]] = []
    dropped: list[int] = []
    pending: list[list[int]] = []  # [position, batches waited], oldest first
    batch: list[int] = []
    seen: set[int] = set()

    def offer() -> None:
        nonlocal pending
        left = []
        for item in pending:
            if len(batch) < batch_size and seen.isdisjoint(texts[item[0]]):
                batch.append(item[0])
                seen.update(texts[item[0]])
            else:
                left.append(item)
        pending = left

    def emit() -> None:
        nonlocal batch, seen, pending
        batches.append(batch)
        batch, seen = [], set()
        for item in pending:
            item[1] += 1
        dropped.extend(i for i, age in pending if age >= window)
        pending = [item for item in pending if item[1] < window]

    offer()
    for i in range(len(rows)):
        if seen.isdisjoint(texts[i]):
            batch.append(i)
            seen.update(texts[i])
        else:
            pending.append([i, -1])
            while len(pending) > window * batch_size:
                dropped.append(pending.pop(0)[0])
        while len(batch) == batch_size:
            emit()
            offer()
    short: list[int] = []
    left = 0
    while batch or pending:
        if len(batch) == batch_size:
            emit()
        else:
            if not drop_last and len(batch) > len(short) and len(batch) >= min(2, batch_size):
                left += len(short)
                short = batch
            else:
                left += len(batch)
            batch, seen = [], set()
        offer()
    if short:
        batches.append(short)
    return batches, sorted(dropped), left


def run(hashes: np.ndarray, batch_size: int, window: int, drop_last: bool = True, chunks=(4,)):
    """The batcher over ``hashes`` pushed in chunks of the given sizes (cycled): batches as lists, counts."""
    batcher = WindowedBatcher(batch_size, window, drop_last)
    out, pos, k = [], 0, 0
    while pos < len(hashes):
        size = chunks[k % len(chunks)]
        out += batcher.push(hashes[pos : pos + size])
        pos, k = pos + size, k + 1
    out += batcher.finish()
    return [b.tolist() for b in out], batcher.counts


# Ten rows of (anchor, positive) texts; a..q name the texts.
HAND = ["ab", "ac", "ad", "ef", "gh", "ij", "ck", "lm", "no", "pq"]


def hand_hashes() -> np.ndarray:
    return np.array([[ord(a), ord(p)] for a, p in HAND], dtype=np.uint64)


def test_hand_made_stream_window_1():
    # Batch 1: r0 taken, r1 and r2 refused (a), r3 r4 fill it. Batch 2: deferred r1 taken, r2 refused
    # again (a: its one later batch is gone -> dropped), r5, r6 refused (c, r1's positive, as anchor),
    # r7. Batch 3: deferred r6, then r8 r9.
    batches, counts = run(hand_hashes(), 3, 1)
    assert batches == [[0, 3, 4], [1, 5, 7], [6, 8, 9]]
    assert counts == WindowCounts(rows_read=10, batches=3, placed=9, dropped=1, deferred=3, left_at_end=0, buffered=0)


def test_hand_made_stream_window_2():
    # r2 waits a second batch and joins batch 3 with r6 and r8; r9 is the end's 1-row batch.
    for drop_last in (True, False):
        batches, counts = run(hand_hashes(), 3, 2, drop_last)
        assert batches == [[0, 3, 4], [1, 5, 7], [2, 6, 8]]
        assert counts == WindowCounts(10, 3, 9, dropped=0, deferred=3, left_at_end=1, buffered=0)


def test_hand_made_stream_window_0_drops_at_once_and_drop_last():
    # W = 0: r1 and r2 dropped when refused; r6 then fits (r1 never placed). The end's [8, 9]
    # is kept only without drop_last.
    batches, counts = run(hand_hashes(), 3, 0, drop_last=True)
    assert batches == [[0, 3, 4], [5, 6, 7]]
    assert counts == WindowCounts(10, 2, 6, dropped=2, deferred=2, left_at_end=2, buffered=0)
    batches, counts = run(hand_hashes(), 3, 0, drop_last=False)
    assert batches == [[0, 3, 4], [5, 6, 7], [8, 9]]
    assert counts == WindowCounts(10, 3, 8, dropped=2, deferred=2, left_at_end=0, buffered=0)


def random_stream(rows: int, columns: int, duplicate_share: float, seed: int, recent: int = 0) -> np.ndarray:
    """Distinct texts, ``duplicate_share`` of the cells a copy of an earlier cell (any column; with
    ``recent``, one of the last ``recent`` cells: duplicates close together, as in a sorted file)."""
    rng = np.random.default_rng(seed)
    h = rng.integers(1, 2**62, size=(rows, columns), dtype=np.uint64)
    flat = h.ravel()
    for i in np.flatnonzero(rng.random(flat.size) < duplicate_share):
        if i > 0:
            flat[i] = flat[rng.integers(max(0, i - recent) if recent else 0, i)]
    return h


@pytest.mark.parametrize(
    ("batch_size", "window", "drop_last", "seed"),
    [(3, 0, True, 0), (4, 1, True, 1), (5, 2, False, 2), (8, 4, False, 3), (2, 3, True, 4), (16, 1, False, 5)],
)
def test_batcher_is_the_row_by_row_rule(batch_size, window, drop_last, seed):
    h = random_stream(300, 2, 0.2, seed)
    batches, counts = run(h, batch_size, window, drop_last, chunks=(1, 7, 3, 50))
    want, dropped, left = reference(h.tolist(), batch_size, window, drop_last)
    assert batches == want
    assert counts.dropped == len(dropped) and counts.left_at_end == left


def test_no_batch_shares_a_text_and_each_row_once():
    # A seeded stream with 20 % duplicate cells, three columns, a small and a wide window.
    h = random_stream(5000, 3, 0.2, 7, recent=300)
    for window in (1, 8):
        batches, counts = run(h, 64, window, chunks=(1000, 333))
        placed = [i for b in batches for i in b]
        assert len(placed) == len(set(placed)) == counts.placed
        for b in batches:
            per_row = [set(r) for r in h[b].tolist()]  # a text repeated inside one row is one text
            assert len(set().union(*per_row)) == sum(map(len, per_row)), "two rows of a batch share a text"
            assert len(b) == 64
        assert counts.deferred > counts.dropped and (counts.dropped > 0 or window > 1)
        assert counts.rows_read == counts.placed + counts.dropped + counts.left_at_end == 5000


def test_a_window_past_the_stream_is_the_full_table_sampler():
    # Fed the full-table sampler's permutation, a window longer than the stream drops nothing and
    # gives exactly build_batches_flat's batches (so the same rows, as sets).
    h = random_stream(2000, 2, 0.2, 11)
    for drop_last in (True, False):
        rows, bounds, unplaced = build_batches_flat(h, 32, drop_last, seed=5)
        order = np.random.default_rng(5).permutation(len(h))
        batches, counts = run(h[order], 32, 10_000, drop_last, chunks=(100, 17))
        got = [order[b].tolist() for b in batches]
        assert got == [rows[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
        assert counts.dropped == 0 and counts.left_at_end == unplaced
        assert set(order[[i for b in batches for i in b]].tolist()) == set(rows.tolist())


def test_the_deferred_rows_are_bounded_by_the_window():
    # One text in every row: each batch takes one row and refuses the others; at most W x B wait.
    h = np.full((100, 1), 7, dtype=np.uint64)
    batcher = WindowedBatcher(4, 2)
    assert batcher.push(h) == []
    assert batcher.counts.buffered <= (2 + 1) * 4
    assert batcher.counts.dropped == 100 - batcher.counts.buffered
    batcher.finish()
    assert batcher.counts.batches == 0 and batcher.counts.placed == 0


def test_windowed_batches_passes_payloads_and_frees_dropped_ones():
    h = hand_hashes()
    counts = WindowCounts()
    chunks = [(h[i : i + 4], HAND[i : i + 4]) for i in range(0, 10, 4)]
    batches = list(windowed_batches(chunks, 3, 1, counts=counts))
    assert batches == [["ab", "ef", "gh"], ["ac", "ij", "lm"], ["ck", "no", "pq"]]
    assert counts.dropped == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        WindowedBatcher(0, 1)
    with pytest.raises(ValueError, match="window"):
        WindowedBatcher(2, -1)
    b = WindowedBatcher(2, 1)
    b.push(np.zeros((1, 2), dtype=np.uint64))
    with pytest.raises(ValueError, match="columns"):
        b.push(np.zeros((1, 3), dtype=np.uint64))


def tokenizer():
    from transformers import BertTokenizerFast

    chars = list(string.ascii_lowercase + string.digits + ".,'!?-")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars] + ["caption", "photo"]
    return BertTokenizerFast(vocab={t: i for i, t in enumerate(dict.fromkeys(vocab))}, do_lower_case=True)


def write_shards(folder, rows, shards):
    folder.mkdir()
    for k in range(shards):
        with gzip.open(folder / f"part-{k:02d}.jsonl.gz", "wt") as f:
            for row in rows[k::shards]:
                f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("shuffle_buffer", [0, 50])
def test_streaming_source_tokenizes_and_deals_each_rank_its_slice_of_the_global_batches(tmp_path, shuffle_buffer):
    """Every rank reads the whole stream and builds the same global batches (B x world_size rows):
    rank r trains rows [r x B, (r + 1) x B) of each, so no text repeats in a global batch and the
    global batches are one process's of B x world_size rows (issue 38 item 6)."""
    from cembed.config.sources import FileSource

    # Anchors repeat every 11 rows and differ only in case, which the uncased tokenizer removes:
    # compared by token ids they are one text.
    rows = [
        {"anchor": ("Caption " if i % 2 else "caption ") + str(i % 11), "positive": f"photo {i}"} for i in range(120)
    ]
    write_shards(tmp_path / "shards", rows, 4)
    tok = tokenizer()

    def source(batch_size, rank=0, world=1):
        path = FileSource(path=str(tmp_path / "shards"))
        return StreamingSource(
            path, ["anchor", "positive"], tok, 16, batch_size, 2, rank, world, shuffle_buffer=shuffle_buffer, seed=4,
            read_rows=9,
        )  # fmt: skip

    one = source(8)
    whole = list(one)
    slices = {rank: list(src) for rank, src in ((r, source(4, r, 2)) for r in range(2))}
    assert len(whole) >= 3 and len(slices[0]) == len(slices[1]) == len(whole)
    for step, batch in enumerate(whole):
        assert slices[0][step] + slices[1][step] == batch  # rank 0's rows, then rank 1's: one process's batch
        ids = [tuple(r["anchor_input_ids"]) for r in batch] + [tuple(r["positive_input_ids"]) for r in batch]
        assert len(set(ids)) == len(ids), "a shared text (as token ids) in a global batch"
        for r in batch:
            assert r["anchor_input_ids"] == tok(r["anchor"], truncation=True, max_length=16)["input_ids"]
    for rank in range(2):
        src = source(4, rank, 2)
        list(src)
        assert src.counts == one.counts and src.counts.rows_read == 120  # the whole stream, on every rank
    c = one.counts
    assert c.placed == 8 * len(whole) and c.rows_read == c.placed + c.dropped + c.left_at_end


def test_several_ranks_use_only_whole_global_batches(tmp_path):
    """Without drop_last one process keeps a short last batch; ranks would get unequal slices of it
    (a step on one rank only), so with several processes only whole global batches are dealt."""
    from cembed.config.sources import FileSource

    write_shards(tmp_path / "shards", [{"anchor": f"caption {i}", "positive": f"photo {i}"} for i in range(21)], 1)
    path = FileSource(path=str(tmp_path / "shards"))
    alone = list(StreamingSource(path, ["anchor", "positive"], tokenizer(), 16, 8, 1, drop_last=False))
    assert [len(b) for b in alone] == [8, 8, 5]
    for rank in range(2):
        dealt = list(StreamingSource(path, ["anchor", "positive"], tokenizer(), 16, 4, 1, rank, 2, drop_last=False))
        assert dealt == [b[4 * rank : 4 * rank + 4] for b in alone[:2]]


def test_hash_of_streamed_ids_is_the_tables():
    # The stream hashes token ids as the full-table sampler does (same function, list<int32> column).
    import pyarrow as pa

    ids = [[2, 10, 11, 3], [2, 10, 11, 3], [2, 11, 10, 3]]
    h = hash_token_ids(pa.array(ids, type=pa.list_(pa.int32())))
    assert h[0] == h[1] != h[2]


def test_a_training_loop_over_streaming_rows_sees_the_windowed_batches(tmp_path):
    import torch

    from cembed.config.sources import FileSource
    from cembed.data.batching.stream import StreamingRows
    from cembed.data.tokens.collator import PaddingCollator

    rows = [{"anchor": f"caption {i % 5}", "positive": f"photo {i}"} for i in range(50)]
    write_shards(tmp_path / "shards", rows, 2)
    tok = tokenizer()
    source = StreamingSource(
        FileSource(path=str(tmp_path / "shards")), ["anchor", "positive"], tok, 16, 4, 2, read_rows=7
    )
    want = [[(r["anchor_input_ids"], r["positive_input_ids"]) for r in b] for b in source]
    assert len(want) >= 5

    collate = PaddingCollator(["anchor", "positive"], tok.pad_token_id, token_type_ids=False)
    loader = torch.utils.data.DataLoader(StreamingRows(source), batch_size=4, collate_fn=collate)
    torch.manual_seed(0)
    encoder = torch.nn.EmbeddingBag(len(tok), 8, mode="mean", padding_idx=tok.pad_token_id)
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.1)
    seen = []
    for batch in loader:
        unpadded = {
            role: [
                ids[mask.bool()].tolist()
                for ids, mask in zip(batch[f"{role}_input_ids"], batch[f"{role}_attention_mask"])
            ]
            for role in ("anchor", "positive")
        }
        seen.append(list(zip(unpadded["anchor"], unpadded["positive"])))
        # One in-batch contrastive step (each anchor's positive against the batch's others).
        a, p = (encoder(batch[f"{r}_input_ids"]) for r in ("anchor", "positive"))
        loss = torch.nn.functional.cross_entropy(a @ p.T, torch.arange(len(a)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)
    assert seen == want


class _Passes:
    """A source whose pass ``e`` (set_epoch) yields ``e + 1`` one-row batches, none from pass 3 on."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter([[(self.epoch, i)] for i in range(self.epoch + 1)] if self.epoch < 3 else [])


def test_endless_rows_read_pass_after_pass_from_the_set_epoch_and_stop_at_an_empty_pass():
    rows = StreamingRows(_Passes(), endless=True)
    assert list(rows) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    rows.set_epoch(2)
    assert list(rows) == [(2, 0), (2, 1), (2, 2)]
    assert list(StreamingRows(_Passes())) == [(0, 0)]  # not endless: one pass per iteration


# --- the edges, one behavior each (written against `make mutate`'s survivors): which rows
# pop_dropped hands back and when, the end of the stream (deferred rows packed into full batches, the
# largest short batch kept, the rows left counted), a push after finish, uint64 hashes, and
# windowed_batches passing its arguments through.


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


def _chunks():
    h = hand_hashes()
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


def test_without_drop_last_a_larger_later_batch_replaces_the_kept_one_and_its_rows_count_as_left():
    # B = 4: r1 r2 r3 each share one text with r0 and none with each other; the end's batches are
    # [0, 4] (2 rows, kept at first) and [1, 2, 3] (larger: kept instead, [0, 4] left).
    batcher = WindowedBatcher(4, 2, drop_last=False)
    rows = [(1, 10, 100), (1, 11, 101), (10, 12, 102), (100, 13, 103), (2, 14, 104)]
    assert batcher.push(_h(rows)) == []
    assert [b.tolist() for b in batcher.finish()] == [[1, 2, 3]]
    assert batcher.counts == WindowCounts(rows_read=5, batches=1, placed=3, deferred=3, left_at_end=2)


@pytest.mark.parametrize("window", [1, 2, 3])
def test_a_deferred_row_joins_the_last_batch_of_its_window_and_not_one_more(window):
    """The boundary at exactly the window's length: B = 2, rows a_1 .. a_{W+2} share their anchor
    "a" (a batch takes one), each after a filler f_j of its own texts. Batch 1 takes a_1 and f_1 and
    defers a_2 .. a_{W+2} (W + 1 rows, within the W x B bound); batch j + 1 takes the oldest, a_{j+1},
    which has waited j batches. a_{W+1} waits exactly W and joins batch W + 1; a_{W+2} would need
    W + 1 and is dropped when batch W + 1 closes (a window of W + 1 batches would place it)."""
    n = window + 2
    hashes = [(1, 100 + i) for i in range(n)] + [(200 + j, 300 + j) for j in range(n)]
    batches, counts = run(_h(hashes), 2, window, chunks=(len(hashes),))
    fillers = list(range(n, 2 * n))
    assert batches[: window + 1] == [[0, fillers[0]]] + [[j, fillers[j]] for j in range(1, window + 1)]
    assert not any(n - 1 in b for b in batches) and counts.dropped == 1
    assert batches == reference(hashes, 2, window, True)[0]
