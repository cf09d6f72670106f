#!/usr/bin/env python
"""Fetch cost of one training batch against corpus rows (issue 24 item 3: "fetching a batch costs the
same at 100M rows as at 1M").

For each size, writes a memory-mapped Arrow stream file of token ids the way ``datasets`` writes a
pre-tokenized column (``list<int32>``, 1,000 rows per record batch; lengths 8-56 tokens, seeded),
opens it with ``datasets.Dataset.from_file`` and times the gather of a random batch of ``--batch``
rows (the sampler's index list) with:

- ``per file``: :class:`cembed.data.tokens.collator.IdColumn` as it is now (one vectorised gather per
  memory-mapped file);
- ``per record batch``: the previous gather (one numpy step per record batch the batch touches),
  reproduced below as the reference.

Both give the same ids (checked). Prints the median of ``--repeat`` gathers per size, and the ratio.

Usage::

    python scripts/bench_fetch.py [--sizes 1000000,3000000,10000000] [--batch 65536] [--repeat 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from cembed.data.tokens.collator import IdColumn, RaggedIds, ragged_positions

RECORD_BATCH_ROWS = 1000  # datasets' writer_batch_size


def write_ids(path: Path, rows: int, seed: int) -> None:
    """``rows`` rows of random ids (8-56 tokens) as an Arrow stream of 1,000-row record batches."""
    rng = np.random.default_rng(seed)
    schema = pa.schema([("anchor_input_ids", pa.list_(pa.int32()))])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            lengths = rng.integers(8, 57, n)
            offsets = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(lengths, out=offsets[1:])
            values = rng.integers(0, 30_000, int(offsets[-1]), dtype=np.int32)
            arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            for k in range(0, n, RECORD_BATCH_ROWS):
                writer.write_batch(pa.record_batch([arr.slice(k, RECORD_BATCH_ROWS)], schema=schema))


def per_record_batch_views(column) -> tuple:
    """The previous IdColumn's state, built once per table: first rows, per-chunk numpy views."""
    chunks = [c for c in column.chunks if len(c)]
    first_row = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in chunks], out=first_row[1:])
    return first_row, [c.offsets.to_numpy() for c in chunks], [c.values.to_numpy(zero_copy_only=False) for c in chunks]


def take_per_record_batch(views: tuple, rows: np.ndarray) -> RaggedIds:
    """The gather before the per-file regions: one numpy step per record batch touched (reference)."""
    first_row, offsets_list, values_list = views
    n = len(rows)
    chunk = np.searchsorted(first_row, rows, side="right") - 1
    local = rows - first_row[chunk]
    order = np.argsort(chunk, kind="stable")
    groups = np.split(order, np.flatnonzero(np.diff(chunk[order])) + 1)
    begin, lengths = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for sel in groups:
        offs, at = offsets_list[chunk[sel[0]]], local[sel]
        begin[sel] = offs[at]
        lengths[sel] = offs[at + 1] - begin[sel]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.empty(int(offsets[-1]), dtype=values_list[0].dtype)
    for sel in groups:
        src = ragged_positions(begin[sel], lengths[sel])
        values[ragged_positions(offsets[sel], lengths[sel])] = values_list[chunk[sel[0]]][src]
    return RaggedIds(offsets, values)


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,3000000,10000000")
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from datasets import Dataset

    print(f"{'rows':>11} {'record batches':>15} {'per file s':>11} {'per record batch s':>19} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for k, rows in enumerate(int(s) for s in args.sizes.split(",")):
            path = Path(tmp) / f"ids-{rows}.arrow"
            write_ids(path, rows, seed=k)
            column = Dataset.from_file(str(path)).data.table.column("anchor_input_ids")
            batch = np.random.default_rng(1000 + k).choice(rows, size=min(args.batch, rows), replace=False)
            ids = IdColumn(column)  # built once per table, as TokenIdRows does
            views = per_record_batch_views(column)
            new, old = ids.take(batch), take_per_record_batch(views, batch)
            assert np.array_equal(new.offsets, old.offsets) and np.array_equal(new.values, old.values)
            t_new = median_seconds(lambda: ids.take(batch), args.repeat)
            t_old = median_seconds(lambda: take_per_record_batch(views, batch), args.repeat)
            print(f"{rows:>11,} {column.num_chunks:>15,} {t_new:>11.3f} {t_old:>19.3f} {t_old / t_new:>5.1f}x")
            path.unlink()


if __name__ == "__main__":
    main()
