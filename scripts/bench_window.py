#!/usr/bin/env python
"""Duplicates and unused rows of streaming batches against the full-table sampler (issue 24 item 4).

On the same rows, three ways to form batches of ``B`` rows:

- **plain**: consecutive rows of the stream, no rule (what a streaming loader gives by itself);
- **window W**: :class:`cembed.data.batching.windowed.WindowedBatcher` over the stream, for W = 0, 1, 2, 4, 8
  (W = 0: a refused row is dropped at once);
- **full table**: :class:`cembed.data.batching.full_table.NoDuplicatesSampler` over the whole table (epoch 0).

For each: the shared-text pairs per batch (for each text, the pairs of rows of one batch holding it,
across all columns; a false in-batch negative each), the share of batches with at least one, the rows
the window dropped, the rows unused in the epoch (dropped, and the end's rows under ``drop_last``),
and the batcher's speed in rows per CPU second (the window: the batcher alone, hashes given; the full
table: building the epoch's batches, hashes given).

Texts are hashed as raw text (:func:`cembed.data.identity.hash_texts`), for speed: the same equality as
token ids up to what the tokenizer normalizes (an uncased tokenizer also merges texts that differ only
in case or spacing, so a token-id run finds a few more duplicates). ``drop_last`` everywhere.

Data: the COCO caption pairs shipped in ``cembed/samples/coco_captions`` (40,066 pairs, five captions
per image paired both ways: each caption recurs as anchor and positive), as a stream in file order
(rows of one image together: a stream's worst case), through a streaming shuffle buffer of 10,000
rows (``datasets``' algorithm), and shuffled (the full-table sampler's own permutation, i.e. a stream
shuffled perfectly); and the synthetic corpus of ``scripts/bench_scale.py``
(~5 % of each column a copy of an earlier row's text, anywhere before it), in file order.

    python scripts/bench_window.py                 # ~1-2 minutes on 2 cores
    python scripts/bench_window.py --synthetic-rows 0 --coco-batches 128
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
COCO = REPO / "cembed" / "samples" / "coco_captions" / "train_pairs.jsonl.gz"
WINDOWS = (0, 1, 2, 4, 8)
SHUFFLE_BUFFER = 10_000  # a streaming shuffle buffer's rows (datasets' default is 1,000)
READ_ROWS = 8192  # rows per chunk pushed into the batcher (a streaming reader's record batch)


def shared_pairs(hashes: np.ndarray, batches: list[np.ndarray]) -> np.ndarray:
    """Per batch, the pairs of rows sharing a text: for each text, ``c (c - 1) / 2`` where ``c`` rows
    of the batch hold it (a text repeated inside one row counts once for that row). ``hashes``:
    ``(rows, columns)``; ``batches``: row-index arrays. Shape ``(len(batches),)`` int64."""
    out = np.zeros(len(batches), dtype=np.int64)
    for b, rows in enumerate(batches):
        h = hashes[rows]
        # One entry per (row, text): repeats inside a row removed by sorting each row.
        h = np.sort(h, axis=1)
        keep = np.ones(h.shape, dtype=bool)
        keep[:, 1:] = h[:, 1:] != h[:, :-1]
        _, counts = np.unique(h[keep], return_counts=True)
        out[b] = int((counts * (counts - 1) // 2).sum())
    return out


def buffer_shuffled(n: int, buffer_size: int, seed: int) -> np.ndarray:
    """The order the installed ``datasets``' ``IterableDataset.shuffle(buffer_size=...)`` reads ``n``
    rows in (its algorithm: when the buffer is full, shuffle it, yield half, keep half; at the end
    shuffle the rest)."""
    rng = np.random.default_rng(seed)
    out, buffer, pos, keep = [], np.empty(0, dtype=np.int64), 0, buffer_size // 2
    while pos < n:
        new = np.arange(pos, min(pos + buffer_size - len(buffer), n))
        pos += len(new)
        buffer = np.concatenate([buffer, new])
        if len(buffer) >= buffer_size:
            buffer = buffer[rng.permutation(len(buffer))]
            out.append(buffer[: len(buffer) - keep])
            buffer = buffer[len(buffer) - keep :]
    out.append(buffer[rng.permutation(len(buffer))])
    return np.concatenate(out)


def plain_batches(n: int, batch_size: int) -> list[np.ndarray]:
    """Consecutive rows, ``drop_last``."""
    return [np.arange(s, s + batch_size) for s in range(0, n - batch_size + 1, batch_size)]


def windowed(hashes: np.ndarray, batch_size: int, window: int):
    """The windowed batches of ``hashes`` read in stream order: ``(batches, counts, CPU s)``."""
    from cembed.data.batching.windowed import WindowedBatcher

    batcher = WindowedBatcher(batch_size, window, drop_last=True)
    batches = []
    start = time.process_time()
    for s in range(0, len(hashes), READ_ROWS):
        batches += batcher.push(hashes[s : s + READ_ROWS])
    batches += batcher.finish()
    return batches, batcher.counts, time.process_time() - start


def full_table(columns: dict[str, list[str]], batch_size: int, seed: int):
    """NoDuplicatesSampler over the table: ``(hashes, batches, unplaced, CPU s of the epoch build)``."""
    import datasets

    from cembed.data.batching.full_table import NoDuplicatesSampler

    sampler = NoDuplicatesSampler(
        datasets.Dataset.from_dict(columns), batch_size, drop_last=True, seed=seed, world_size=1
    )
    start = time.process_time()
    batches = [np.asarray(b) for b in sampler.global_batches()]
    return sampler.hashes, batches, sampler.unplaced, time.process_time() - start


def measure(name: str, columns: dict[str, list[str]], sizes: list[int], seed: int, shuffled: bool) -> list[dict]:
    """All methods on one data set at each batch size, as table rows."""
    from cembed.data.identity import hash_texts

    n = len(next(iter(columns.values())))
    hashes = np.stack([hash_texts(texts) for texts in columns.values()], axis=1)
    orders = [("file", np.arange(n))]
    if shuffled:
        orders.append(
            (f"buffer {SHUFFLE_BUFFER // 1000}k", buffer_shuffled(n, SHUFFLE_BUFFER, seed))
        )  # the full-table sampler's own epoch-0 permutation (NoDuplicatesSampler: seed + epoch)
        orders.append(("shuffled", np.random.default_rng(seed).permutation(n)))
    out = []

    def row(order, size, method, batches, hashes_of, dropped, unused, cpu):
        pairs = shared_pairs(hashes_of, batches)
        out.append(
            {
                "data": name,
                "order": order,
                "B": size,
                "method": method,
                "batches": len(batches),
                "pairs_per_batch": float(pairs.mean()) if len(pairs) else 0.0,
                "batches_with_dup": float((pairs > 0).mean()) if len(pairs) else 0.0,
                "dropped": dropped,
                "unused": unused,
                "unused_share": unused / n,
                "rows_per_cpu_s": n / cpu if cpu else None,
            }
        )

    for size in sizes:
        for order, perm in orders:
            stream = hashes[perm]
            batches = plain_batches(n, size)
            row(order, size, "plain", batches, stream, 0, n - size * len(batches), None)
            for w in WINDOWS:
                batches, counts, cpu = windowed(stream, size, w)
                row(order, size, f"window {w}", batches, stream, counts.dropped, n - counts.placed, cpu)
        table_hashes, batches, unplaced, cpu = full_table(columns, size, seed)
        assert np.array_equal(table_hashes, hashes), "the sampler hashed the texts otherwise"
        row("table", size, "full table", batches, hashes, 0, unplaced, cpu)
    return out


def coco_columns() -> dict[str, list[str]]:
    anchors, positives = [], []
    with gzip.open(COCO, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            anchors.append(record["anchor"])
            positives.append(record["positive"])
    return {"anchor": anchors, "positive": positives}


def synthetic_columns(rows: int, seed: int) -> dict[str, list[str]]:
    spec = importlib.util.spec_from_file_location("bench_scale", REPO / "scripts" / "bench_scale.py")
    bench_scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_scale)
    queries, passages = bench_scale.generate_pairs(rows, seed)
    return {"anchor": queries, "positive": passages}


def table(rows: list[dict]) -> str:
    """The measurements as one aligned text table."""
    head = [
        "data",
        "order",
        "B",
        "method",
        "batches",
        "dup pairs/batch",
        "batches w/ dup",
        "dropped",
        "unused/epoch",
        "rows/CPU-s",
    ]
    lines = []
    for r in rows:
        speed = f"{r['rows_per_cpu_s']:,.0f}" if r["rows_per_cpu_s"] else "-"
        lines.append(
            [
                r["data"],
                r["order"],
                f"{r['B']:,}",
                r["method"],
                f"{r['batches']:,}",
                f"{r['pairs_per_batch']:.2f}",
                f"{100 * r['batches_with_dup']:.1f} %",
                f"{r['dropped']:,}",
                f"{r['unused']:,} ({100 * r['unused_share']:.1f} %)",
                speed,
            ]
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coco-batches", default="128,512,2048", help="batch sizes on the COCO pairs")
    parser.add_argument("--synthetic-rows", type=int, default=200_000, help="0: skip the synthetic corpus")
    parser.add_argument("--synthetic-batch", type=int, default=16_384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the raw rows here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = measure("coco", coco_columns(), [int(b) for b in args.coco_batches.split(",") if b], args.seed, True)
    if args.synthetic_rows:
        columns = synthetic_columns(args.synthetic_rows, args.seed)
        rows += measure(f"synthetic {args.synthetic_rows // 1000}k", columns, [args.synthetic_batch], args.seed, False)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    # The rule's guarantee, checked on every run: no duplicate in a windowed or full-table batch.
    broken = [r for r in rows if r["method"] != "plain" and r["pairs_per_batch"] > 0]
    print(
        f"drop_last; texts hashed raw (hash_texts); stream chunks of {READ_ROWS:,} rows; seed {args.seed}; "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    print()
    print(table(rows))
    if broken:
        print(f"\nERROR: {len(broken)} windowed/full-table runs with a duplicate in a batch", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
