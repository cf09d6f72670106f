#!/usr/bin/env python
"""Packing benchmark of the no-duplicates sampler (issue 12 case 7).

Rows used per epoch (``drop_last: true``, seed 0) on the COCO caption pairs at batch 4096 / 8192 /
16384, for three packers over the same permutation:

- ``before``: the sampler as of commit 9e84649 (kept below as :func:`build_batches_before`), whose
  vectorised fit refused a row sharing a text with *any* earlier candidate, even a refused one;
- ``now``: :func:`cembed.data.batching.full_table.build_batches`;
- ``row by row``: :func:`cembed.data.batching.full_table.build_batches_row_by_row`, the exact first fit in Python.

Then the time of one epoch over 1M synthetic rows at batch 65536 (the data of
``scripts/bench_throughput.py``'s sampler section), before and now.

And (section ``plan``) the attention packing plan of one large cached-loss mini-batch
(:mod:`cembed.model.packing`, README "Unpadded attention": "53 ms for a 16,384-row mini-batch where
best-fit took 8 s"): ``plan_packing`` (rows dealt a round at a time, vectorised, used above
``BEST_FIT_MAX_ROWS`` rows) vs best-fit decreasing over the same capacities (the path up to 64 rows),
on seeded skewed lengths (lognormal, median 40 tokens, at most 256), with all-MiniLM-L6-v2's attention
cost. Prints markdown tables.

Usage: ``python scripts/bench_packing.py [--sections sampler,epoch,plan] [--coco PATH] [--rows 1000000]
[--batch 65536] [--plan-rows 16384]``
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np

from cembed.data.batching.full_table import build_batches, build_batches_row_by_row
from cembed.data.identity import hash_texts

COCO = Path(__file__).resolve().parents[1].parent / "shared/data/coco_captions/caption_pairs_val2017.jsonl.gz"


# --- the sampler before issue 12 case 7 (commit 9e84649), verbatim but for the names ---


def _fits_before(hashes: np.ndarray, candidates: np.ndarray, used: np.ndarray) -> np.ndarray:
    """Which candidate rows can join a batch whose texts are ``used`` (sorted), taking the candidates in
    order: a row is refused if any of its texts is in ``used`` or in an earlier candidate row
    (refusing also after an earlier row that was itself refused: conservative, never wrong).
    A text repeated inside one row does not count. Shape ``(len(candidates),)`` bool."""
    h = hashes[candidates]  # (m, k)
    m, k = h.shape
    if m == 0:
        return np.zeros(0, dtype=bool)
    if used.size:
        at = np.minimum(np.searchsorted(used, h), used.size - 1)
        clash = (used[at] == h).any(axis=1)
    else:
        clash = np.zeros(m, dtype=bool)
    flat = h.ravel()
    row_of = np.repeat(np.arange(m), k)
    uniq, first = np.unique(flat, return_index=True)
    first_row = row_of[first][np.searchsorted(uniq, flat)]
    clash |= (first_row != row_of).reshape(m, k).any(axis=1)
    return ~clash


def build_batches_before(
    hashes: np.ndarray, batch_size: int, drop_last: bool, seed: int
) -> tuple[list[list[int]], int]:
    """Duplicate-free batches for one epoch.

    First fit over a seeded permutation, with a FIFO of deferred rows: each new batch first offers
    a place to the rows deferred so far (oldest first), then takes rows from the permutation; a row
    that shares a text with the batch is deferred. The checks run vectorized on whole candidate
    chunks, so an epoch costs a few numpy passes per batch (about linear in the rows).

    Args:
        hashes: ``(rows, columns)`` text hashes, see :func:`row_hashes`.
        batch_size: rows per batch.
        drop_last: drop the rows that cannot form a full batch at the end of the epoch.
        seed: seed of the shuffle (the sampler passes ``seed + epoch``).

    Returns:
        ``(batches, unplaced)``: lists of row indices, and the number of rows left out (only
        non-zero with ``drop_last``).
    """
    n = hashes.shape[0]
    order = np.random.default_rng(seed).permutation(n)
    batches: list[list[int]] = []
    deferred = np.empty(0, dtype=np.int64)
    pos = 0
    rows: list[np.ndarray] = []
    used = np.empty(0, dtype=hashes.dtype)

    def offer(candidates: np.ndarray) -> np.ndarray:
        """Add the fitting candidates (up to the space left); return the others, in order."""
        nonlocal used
        space = batch_size - sum(len(r) for r in rows)
        ok = _fits_before(hashes, candidates, used)
        ok[np.cumsum(ok) > space] = False
        taken = candidates[ok]
        if taken.size:
            rows.append(taken)
            used = np.sort(np.concatenate([used, hashes[taken].ravel()]))
        return candidates[~ok]

    def filled() -> int:
        return sum(len(r) for r in rows)

    while True:
        deferred = offer(deferred)
        while filled() < batch_size and pos < n:
            chunk = order[pos : pos + batch_size - filled()]
            pos += len(chunk)
            deferred = np.concatenate([deferred, offer(chunk)])
        if filled() == batch_size:
            batches.append(np.concatenate(rows).tolist())
            rows, used = [], np.empty(0, dtype=hashes.dtype)
            continue
        break  # permutation exhausted and the batch cannot be filled
    if drop_last:
        return batches, filled() + len(deferred)
    # Keep every row: the partial batch, then duplicate-free batches out of what was deferred.
    while rows or len(deferred):
        if rows:
            batches.append(np.concatenate(rows).tolist())
        rows, used = [], np.empty(0, dtype=hashes.dtype)
        deferred = offer(deferred)
    return batches, 0


def coco_hashes(path: Path) -> np.ndarray:
    """``(rows, 2)`` hashes of the anchor and positive captions."""
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    return np.stack([hash_texts([r["anchor"] for r in rows]), hash_texts([r["positive"] for r in rows])], axis=1)


def rows_used(batches: list[list[int]]) -> int:
    """Rows in the epoch's batches."""
    return sum(len(b) for b in batches)


def packing_table(hashes: np.ndarray, batch_sizes: list[int]) -> None:
    """Print batches and rows used per epoch for each packer at each batch size."""
    n = hashes.shape[0]
    print(f"## rows used per epoch: COCO caption pairs, {n} rows, drop_last, seed 0")
    print(
        "| batch | before: batches | before: rows used | now: batches | now: rows used | row by row: batches | row by row: rows used | now s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for bs in batch_sizes:
        old, _ = build_batches_before(hashes, bs, True, 0)
        t0 = time.perf_counter()
        new, _ = build_batches(hashes, bs, True, 0)
        t = time.perf_counter() - t0
        exact, _ = build_batches_row_by_row(hashes, bs, True, 0)
        assert new == exact, "build_batches must equal the row-by-row first fit"
        cells = []
        for b in (old, new, exact):
            used = rows_used(b)
            cells += [str(len(b)), f"{used} ({100 * used / n:.1f}%, {n - used} unused)"]
        print(f"| {bs} | {' | '.join(cells)} | {t:.2f} |")


def epoch_time_table(rows: int, batch: int, repeats: int = 3) -> None:
    """Print the best-of-``repeats`` time of one epoch of each packer over ``rows`` synthetic rows."""
    rng = np.random.default_rng(4)
    # ~2% of anchors repeat another row's text, like real query logs (as in bench_throughput.py).
    anchors = hash_texts([f"query {i}" for i in rng.integers(0, int(rows * 0.98), rows)])
    hashes = np.stack([anchors, hash_texts([f"passage {i}" for i in range(rows)])], axis=1)
    print(f"\n## one epoch over {rows} rows at batch {batch} (drop_last, best of {repeats})")
    print("| packer | epoch s | batches | rows used |")
    print("|---|---|---|---|")
    for label, fn in (("before (9e84649)", build_batches_before), ("now", build_batches)):
        best, batches = float("inf"), []
        for seed in range(repeats):
            t0 = time.perf_counter()
            batches, _ = fn(hashes, batch, True, seed)
            best = min(best, time.perf_counter() - t0)
        print(f"| {label} | {best:.2f} | {len(batches)} | {rows_used(batches)} |")


def plan_time_table(rows: int, repeats: int = 3) -> None:
    """Print the best-of-``repeats`` time of packing one mini-batch of ``rows`` skewed lengths: the
    vectorised deal (``plan_packing``, index tensors included) vs best-fit decreasing (packs only),
    with the packs, pack width and padded share of the packed positions each gives. Wall and CPU
    seconds (the CPU time of this process is what a busy shared machine does not inflate)."""
    from transformers import AutoConfig

    from cembed.model.load import resolve_model_path
    from cembed.model.packing import attention_cost, choose_packs, plan_packing

    cost = attention_cost(AutoConfig.from_pretrained(resolve_model_path("all-MiniLM-L6-v2")))
    lengths = np.clip(np.random.default_rng(3).lognormal(np.log(40), 0.9, rows).astype(int), 1, 256)
    print(f"\n## attention pack plan of one {rows}-row mini-batch (skewed lengths, best of {repeats})")
    print("| packer | wall s | CPU s | packs | pack width | padded share |")
    print("|---|---|---|---|---|---|")
    for label in ("dealt, vectorised (plan_packing)", "best-fit decreasing"):
        best = best_cpu = float("inf")
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            if label.startswith("dealt"):
                plan = plan_packing(lengths.tolist(), cost)
                packs, width = plan.packs, plan.pack_width
            else:
                chosen, width = choose_packs(lengths.tolist(), cost)
                packs = len(chosen)
            best = min(best, time.perf_counter() - t0)
            best_cpu = min(best_cpu, time.process_time() - c0)  # not inflated by a busy machine
        share = 1 - int(lengths.sum()) / (packs * width)
        print(f"| {label} | {best:.3f} | {best_cpu:.3f} | {packs} | {width} | {100 * share:.1f}% |")


def main() -> None:
    """Parse the flags and print the selected sections' tables."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coco", type=Path, default=COCO)
    p.add_argument("--batch-sizes", default="4096,8192,16384")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--plan-rows", type=int, default=16384, help="rows of the mini-batch the plan section packs")
    p.add_argument("--sections", default="sampler,epoch,plan", help="comma-separated: sampler, epoch, plan")
    args = p.parse_args()
    sections = args.sections.split(",")
    if "sampler" in sections:
        packing_table(coco_hashes(args.coco), [int(b) for b in args.batch_sizes.split(",")])
    if "epoch" in sections:
        epoch_time_table(args.rows, args.batch)
    if "plan" in sections:
        plan_time_table(args.plan_rows)


if __name__ == "__main__":
    main()
