"""Packing plans for unpadded attention (:mod:`cembed.model.unpad`): which rows of a mini-batch share a
pack, and the index tensors that move tokens between the padded and the packed layout.

Up to ``BEST_FIT_MAX_ROWS`` rows: best-fit decreasing bin packing (Johnson 1974) into packs of a
capacity chosen among multiples of the longest row and even splits of the tokens. More rows: the
rows, longest first, dealt a round at a time to the k packs with the fewest tokens (vectorised per
round), k chosen among the pack counts those capacities imply. Either way the choice minimises the estimated cost
``packs x width x (1 + width / (2 hidden + intermediate))``: linear layers cost the same per
position, attention grows with the mask's width; ``width / (2 d_model + d_ff)`` is attention's
share of a layer's FLOPs per token in the ``6N + 12 L H Q T`` count of PaLM (Chowdhery et al. 2022,
arXiv:2204.02311, App. B). One row per pack never costs more than padding.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

# Multiples of the longest row tried as pack capacity (stopping once one pack holds every row).
CAPACITY_FACTORS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)
# Mini-batches of more rows are packed by deal_rows (vectorised per round) instead of best-fit decreasing,
# whose loop per row and capacity tried costs ~0.2 ms per row: seconds per step at batch 65536.
BEST_FIT_MAX_ROWS = 64
# deal_rows hands each round's rows to 1 / DEAL_SHARE of the packs.
DEAL_SHARE = 4
# Headroom over an even split of the tokens, so best-fit can place rows that do not divide evenly.
BALANCE_SLACK = (0.0, 0.01, 0.02, 0.04, 0.08)


@dataclass(frozen=True)
class PackPlan:
    """How one mini-batch's rows are packed; index tensors live on the features' device.

    Attributes:
        rows: rows in the mini-batch.
        width: its padded width (its longest row), the layout the token embeddings go back to.
        packs: packed sequences.
        pack_width: their width (the fullest pack's fill).
        real: non-padding tokens (sum of the row lengths).
        gather: ``(packs * pack_width,)`` long: for each packed position, the padded flat index
            ``row * width + position`` it reads (0 after a pack's last row; those positions attend
            only to each other and are dropped).
        scatter: ``(rows * width,)`` long: for each padded position, the packed flat index holding it
            (0 for padding, which is zeroed).
        segments: ``(packs, pack_width)`` long: the row of each packed position, -1 after the last row.
        positions: ``(packs, pack_width)`` long: each token's position within its own row.
    """

    rows: int
    width: int
    packs: int
    pack_width: int
    real: int
    gather: torch.Tensor
    scatter: torch.Tensor
    segments: torch.Tensor
    positions: torch.Tensor

    @property
    def processed(self) -> int:
        """Positions the encoder runs on: ``packs x pack_width``."""
        return self.packs * self.pack_width


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each row, longest first, goes to the pack with the least room that still
    fits it, else opens a new pack.

    Args:
        lengths: each row's token count (all >= 1 and <= ``capacity``).
        capacity: the most tokens a pack holds.

    Returns:
        The packs, each a list of row indices in placement order (deterministic: ties go to the
        earlier row and the earlier pack).

    Raises:
        ValueError: a row is longer than ``capacity``.
    """
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a row of {max(lengths)} tokens does not fit a pack of {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    packs: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, pack index), sorted
    for i in order:
        k = bisect_left(rooms, (lengths[i], -1))
        if k == len(rooms):
            packs.append([i])
            insort(rooms, (capacity - lengths[i], len(packs) - 1))
        else:
            room, p = rooms.pop(k)
            packs[p].append(i)
            insort(rooms, (room - lengths[i], p))
    return packs


def attention_cost(config) -> float:
    """Attention's encoder cost per position of mask width, relative to the linear layers' per
    token: ``1 / (2 hidden_size + intermediate_size)`` (see the module docstring), from a
    transformers config (``intermediate_size`` defaults to 4 x hidden)."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    if hidden <= 0:
        return 0.0
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    return 1.0 / (2 * hidden + inter)


def choose_packs(lengths: Sequence[int], cost_per_width: float) -> tuple[list[list[int]], int]:
    """The packs (and their width) of least estimated cost over the capacities tried: multiples of
    the longest row (``CAPACITY_FACTORS``) and, for each, the balanced capacity that splits the
    tokens evenly over the same number of packs (plus ``BALANCE_SLACK``), since every pack is padded
    to the fullest one's width."""
    longest, total = max(lengths), sum(lengths)
    capacities: set[int] = set()
    for factor in CAPACITY_FACTORS:
        capacity = min(max(longest, int(longest * factor)), total)
        capacities.add(capacity)
        balanced = max(longest, math.ceil(total / math.ceil(total / capacity)))
        capacities.update(min(total, int(balanced * (1 + slack))) for slack in BALANCE_SLACK)
    best: tuple[float, list[list[int]], int] | None = None
    for capacity in sorted(capacities):
        packs = pack_rows(lengths, capacity)
        width = max(sum(lengths[i] for i in p) for p in packs)
        cost = len(packs) * width * (1.0 + cost_per_width * width)
        if best is None or cost < best[0]:
            best = (cost, packs, width)
    assert best is not None
    return best[1], best[2]


def deal_rows(lengths: np.ndarray, packs: int) -> np.ndarray:
    """Each row's pack when the rows, longest first, are dealt in rounds of ``packs / DEAL_SHARE``
    rows, each round's longest row going to the pack with the fewest tokens so far (longest
    processing time first, Graham 1969, applied a round at a time): a pack that got a long row skips
    rounds, and the packs' sums end within about one of the last (shortest) rows. One vectorised
    step per round (``DEAL_SHARE`` x rows per pack rounds), not per row, for large mini-batches. ``lengths``: ``(rows,)``; returns ``(rows,)`` int64 pack indices."""
    order = np.argsort(-lengths, kind="stable")
    ranked = np.zeros(len(lengths), dtype=np.int64)
    sums = np.zeros(packs, dtype=np.int64)
    step = max(1, packs // DEAL_SHARE)  # a round fills a quarter of the packs: a heavy pack can skip rounds
    for start in range(0, len(lengths) if packs > 1 else 0, step):
        rows = order[start : start + step]
        emptiest = np.argsort(sums, kind="stable")[: len(rows)]
        ranked[start : start + len(rows)] = emptiest
        sums[emptiest] += lengths[rows]
    out = np.empty(len(lengths), dtype=np.int64)
    out[order] = ranked
    return out


def _choose_dealt(lens: np.ndarray, cost_per_width: float) -> np.ndarray:
    """The dealt assignment (:func:`deal_rows`) of least estimated cost over the pack counts the capacities of
    ``CAPACITY_FACTORS`` imply (and their neighbours)."""
    longest, total = int(lens.max()), int(lens.sum())
    counts: set[int] = set()
    for factor in CAPACITY_FACTORS:
        k = math.ceil(total / min(max(longest, int(longest * factor)), total))
        counts.update(c for c in (k - 1, k, k + 1) if 1 <= c <= len(lens))
    best: tuple[float, np.ndarray] | None = None
    for k in sorted(counts):
        row_pack = deal_rows(lens, k)
        width = int(np.bincount(row_pack, weights=lens, minlength=k).max())
        cost = k * width * (1.0 + cost_per_width * width)
        if best is None or cost < best[0]:
            best = (cost, row_pack)
    assert best is not None
    return best[1]


def plan_packing(
    lengths: Sequence[int], cost_per_width: float, device: torch.device | str = "cpu", capacity: int | None = None
) -> PackPlan:
    """Pack rows of ``lengths`` tokens (right-padded in their mini-batch) and build the index tensors.

    Args:
        lengths: each row's token count (>= 1).
        cost_per_width: :func:`attention_cost` of the model (0: width is free, pack as full as possible).
        device: where the index tensors go (the features' device).
        capacity: a fixed pack capacity instead of the cost-based choice (tests).

    Up to ``BEST_FIT_MAX_ROWS`` rows are packed best-fit decreasing over several capacities
    (:func:`pack_rows`); more by :func:`deal_rows` over several pack counts; each keeps the
    choice of least estimated cost ``packs x width x (1 + cost_per_width x width)``.

    Returns:
        A :class:`PackPlan`.
    """
    lens = np.asarray([int(n) for n in lengths], dtype=np.int64)
    rows, width = len(lens), int(lens.max())
    if capacity is None and rows > BEST_FIT_MAX_ROWS:
        row_pack, placement = _choose_dealt(lens, cost_per_width), -lens  # longest first in each pack
    else:
        lengths = lens.tolist()
        packs = choose_packs(lengths, cost_per_width)[0] if capacity is None else pack_rows(lengths, capacity)
        row_pack, placement = np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64)
        members = np.fromiter((r for p in packs for r in p), dtype=np.int64, count=rows)
        row_pack[members] = np.repeat(np.arange(len(packs)), [len(p) for p in packs])
        placement[members] = np.arange(rows)
    n_packs = int(row_pack.max()) + 1
    fills = np.bincount(row_pack, weights=lens, minlength=n_packs).astype(np.int64)
    pack_width = int(fills.max())
    # each row's offset in its pack: the lengths of the rows placed before it there
    order = np.lexsort((placement, row_pack))
    before = np.cumsum(lens[order]) - lens[order]
    row_offset = np.empty(rows, dtype=np.int64)
    row_offset[order] = before - (np.cumsum(fills) - fills)[row_pack[order]]
    total = int(lens.sum())
    row_of_token = np.repeat(np.arange(rows, dtype=np.int64), lens)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    pos = np.arange(total, dtype=np.int64) - starts  # each token's position in its row
    src = row_of_token * width + pos
    dst = row_pack[row_of_token] * pack_width + row_offset[row_of_token] + pos
    n_packed = n_packs * pack_width
    gather = np.zeros(n_packed, dtype=np.int64)
    gather[dst] = src
    scatter = np.zeros(rows * width, dtype=np.int64)
    scatter[src] = dst
    segments = np.full(n_packed, -1, dtype=np.int64)
    segments[dst] = row_of_token
    positions = np.zeros(n_packed, dtype=np.int64)
    positions[dst] = pos

    shape2d = (n_packs, pack_width)
    arrays = (gather, scatter, segments.reshape(shape2d), positions.reshape(shape2d))
    tensors = [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]
    return PackPlan(rows, width, n_packs, pack_width, total, *tensors)
