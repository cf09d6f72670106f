"""The no-duplicates rule for one batch: which candidate rows fit beside the rows already taken.

Shared by the full-table sampler (:mod:`cembed.data.batching.full_table`) and the windowed rule
(:mod:`cembed.data.batching.windowed`): vectorised over a chunk of candidates.
"""

from __future__ import annotations

import numpy as np

# Rounds of the vectorised exact fit before the rest of a chunk is decided row by row (a long chain
# of rows each sharing a text with the next needs one round per link).
_ROUNDS = 24


def _sorted_member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``values`` (any shape) that are in ``sorted_set`` (sorted 1-d), same shape, bool."""
    if sorted_set.size == 0:
        return np.zeros(values.shape, dtype=bool)
    at = np.minimum(np.searchsorted(sorted_set, values), sorted_set.size - 1)
    return sorted_set[at] == values


def fits(hashes: np.ndarray, candidates: np.ndarray, used: np.ndarray, space: int) -> np.ndarray:
    """Which candidate rows join a batch whose texts are ``used`` (sorted) with room for ``space``
    more rows, exactly as a row-by-row first fit taking the candidates in order decides: a row is
    refused if one of its texts is in ``used`` or in an earlier candidate that was *taken* (a clash
    with an earlier refused candidate does not count), and rows past the ``space``-th taken one are
    not taken. A text repeated inside one row does not count. Shape ``(len(candidates),)`` bool.

    Vectorised in rounds over the undecided rows: a row whose texts all first occur in it is taken
    (nothing before it can block it), and a row sharing a text with a row taken this round is
    refused (the taken row is that text's first occurrence). Each round decides at least the first
    undecided row; after ``_ROUNDS`` rounds the rest are decided row by row."""
    h = hashes[candidates]  # (m, k)
    m, k = h.shape
    ok = np.zeros(m, dtype=bool)
    if m == 0 or space <= 0:
        return ok
    if k == 0:  # no text columns: nothing can collide
        ok[:space] = True
        return ok
    undecided = np.flatnonzero(~_sorted_member(h, used).any(axis=1))
    for _ in range(_ROUNDS):
        if ok.sum() >= space:  # rows after the space-th taken one are never looked at
            undecided = undecided[undecided < np.flatnonzero(ok)[space - 1]]
        if undecided.size == 0:
            break
        flat = h[undecided].ravel()
        row_of = np.repeat(np.arange(undecided.size), k)
        uniq, first = np.unique(flat, return_index=True)
        first_row = row_of[first][np.searchsorted(uniq, flat)]
        free = (first_row == row_of).reshape(-1, k).all(axis=1)
        blocked = (free[first_row] & (first_row != row_of)).reshape(-1, k).any(axis=1)
        ok[undecided[free]] = True
        undecided = undecided[~free & ~blocked]
    else:
        seen = set(used.tolist()) | set(h[ok].ravel().tolist())
        for i in undecided.tolist():
            texts = set(h[i].tolist())
            if seen.isdisjoint(texts):
                ok[i] = True
                seen |= texts
    ok[np.cumsum(ok) > space] = False
    return ok
