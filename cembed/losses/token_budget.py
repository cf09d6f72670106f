"""Token-budget mini-batches: a mini-batch holds as many rows as fit ``rows x padded width <= budget``.

``batch.mini_batch_num_tokens`` replaces the fixed row count ``mini_batch_size`` of a cached loss
(GradCache, Gao et al. 2021, arXiv:2101.06983) with a budget of token positions, so a mini-batch of
short rows holds many rows and one of long rows few: with cembed's longest-first sorting
(:class:`cembed.losses.length_sorted.LengthSortedMixin`) short rows travel in large mini-batches, long rows in
small ones, and the encoder does about the same work per mini-batch.

The budget counts *padded* positions, not the non-padding tokens sentence-transformers'
``_minibatch_ranges`` counts. A mini-batch's activation memory grows with its rows times its padded
width (the encoder runs on every position up to the widest row of the mini-batch;
``_create_minibatch`` trims only the trailing columns no row of it uses). Counting non-padding
tokens, a mini-batch that starts at a long row and then packs many short ones is padded to the long
width: one row of 256 tokens and 230 rows of 10 are 2,556 tokens but 59,136 positions, 23 times the
memory of the 10 rows of 256 the same budget allows. Counted in positions, every mini-batch's memory
is at most that of ``budget // max_seq_length`` rows at ``max_seq_length`` (attention's
``rows x width^2`` shrinks with the width too), the worst case ``cembed probe-minibatch`` measures.

The row count ``mini_batch_size`` caps nothing when a budget is set (as in sentence-transformers); it
still cuts columns without an ``attention_mask`` (their widths are unknown).
"""

from __future__ import annotations

import torch


def row_extents(attention_mask: torch.Tensor) -> torch.Tensor:
    """The width each row needs: its last attended column + 1 (right padding: its length).

    Args:
        attention_mask: ``(rows, width)`` 0/1 mask.

    Returns:
        ``(rows,)`` int64 on the mask's device. A row with no attended column gets the full
        ``width`` (sentence-transformers trims nothing for a mini-batch of such rows).
    """
    width = attention_mask.shape[1]
    columns = torch.arange(1, width + 1, device=attention_mask.device)
    extents = (attention_mask.bool() * columns).amax(dim=1)
    return torch.where(extents > 0, extents, torch.full_like(extents, width))


def _fits(extents: list[int], begin: int, end: int, budget: int) -> bool:
    return (end - begin) * max(extents[begin:end]) <= budget


def padded_ranges(extents: list[int], budget: int) -> list[tuple[int, int]]:
    """Cut rows in order into ``(begin, end)`` ranges, each the longest run from ``begin`` with
    ``(end - begin) x max(extents[begin:end]) <= budget`` (greedy; a single row wider than the budget
    forms its own range).

    Args:
        extents: per row, the padded width it needs (tokens), in batch order.
        budget: token positions per mini-batch (>= 1).

    Returns:
        Consecutive ranges covering ``0..len(extents)``. Rows sorted longest first take one slice
        ``max`` per range; unsorted rows a binary search per range.

    Raises:
        ValueError: ``budget`` < 1.
    """
    if budget < 1:
        raise ValueError(f"mini_batch_num_tokens must be at least 1, got {budget}")
    n, ranges, begin = len(extents), [], 0
    while begin < n:
        # the first row's width is a lower bound on the range's width, so this end is an upper bound
        hi = min(n, begin + max(1, budget // max(extents[begin], 1)))
        if not _fits(extents, begin, hi, budget):
            lo = begin + 1  # a single row always forms a range
            while hi - lo > 1:  # invariant: lo fits, hi does not (the condition is monotone in end)
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if _fits(extents, begin, mid, budget) else (lo, mid)
            hi = lo
        ranges.append((begin, hi))
        begin = hi
    return ranges


def token_budget_ranges(feature: dict, budget: int) -> list[tuple[int, int]] | None:
    """:func:`padded_ranges` for one column's features (one host read of its row widths).

    Args:
        feature: a column's tokenized inputs with a ``(rows, width)`` ``attention_mask``.
        budget: token positions per mini-batch.

    Returns:
        The ranges, or None when the column has no 2-D attention mask (the caller then cuts rows by
        ``mini_batch_size``).
    """
    mask = feature.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        return None
    return padded_ranges(row_extents(mask).tolist(), budget)
