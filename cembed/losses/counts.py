"""The counters the throughput meter reads from a loss: token positions (real vs processed, kept on
the device) and, for a false-negative filter, the candidates it masked.

The token counts are device tensors added to without a host read; :meth:`TokenCounts.read` turns
them into numbers once per logging interval, so counting adds no host-device synchronisation per
mini-batch. :class:`FilterCounts` is filled by the guided losses of :mod:`cembed.losses.gist`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FilterCounts:
    """In-batch candidates scored and masked as false negatives since the last :meth:`reset`.

    ``candidates`` counts every (anchor, candidate) score in the softmax except the anchor's own
    positive and, with GIST's ``contrast_anchors`` / ``contrast_positives``, the self-pairs (an anchor
    with itself, a positive with itself), which the guide always masks; ``masked`` counts those of them
    that were left out. With ``loss.matryoshka`` each dimension's loss counts once.
    """

    masked: int = 0
    candidates: int = 0

    def reset(self) -> None:
        self.masked = self.candidates = 0

    def share(self) -> float | None:
        """``masked / candidates``, or None before any candidate was scored."""
        return self.masked / self.candidates if self.candidates else None


@dataclass
class TokenCounts:
    """Token positions seen by the loss since the last :meth:`reset` (read by the meter).

    The loss adds device tensors (:meth:`add`) and never reads them on the host, so counting costs
    no host-device synchronisation; :meth:`read` turns them into numbers with one read (the meter
    calls it once per logging interval). Each attribute is an ``int`` (after :meth:`reset`) or a
    0-dim int64 tensor on the loss's device.
    """

    real: int | torch.Tensor = 0  # non-padding tokens
    processed: int | torch.Tensor = 0  # positions the encoder ran on (rows x padded width, per mini-batch)
    real_sq: int | torch.Tensor = 0  # sum over rows of (non-padding tokens)^2: attention's FLOPs
    # (query token, document token) pairs a late-interaction loss scored in its training steps (a host
    # int: the ragged cache's offsets are host lists), for the scoring FLOPs (cembed.train.flops.scoring_flops)
    scored_pairs: int = 0

    def reset(self) -> None:
        self.real = self.processed = self.real_sq = 0
        self.scored_pairs = 0

    def add(self, real, processed, real_sq) -> None:
        """Add one column's counts (ints or 0-dim tensors; no host read)."""
        self.real = self.real + real
        self.processed = self.processed + processed
        self.real_sq = self.real_sq + real_sq

    def read(self) -> tuple[int, int, int]:
        """``(real, processed, real_sq)`` as ints: one host read of the tensors among them."""
        values = [self.real, self.processed, self.real_sq]
        held = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        if held:
            numbers = torch.stack([values[i].reshape(()).to(torch.int64) for i in held]).tolist()  # the one sync
            for i, number in zip(held, numbers):
                values[i] = number
        real, processed, real_sq = (int(v) for v in values)
        return real, processed, real_sq


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    # A host list as int64 on ``device`` without waiting for it: on CUDA a non-blocking copy from
    # pinned memory (a plain copy would synchronise the stream first).
    tensor = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def count_tokens(
    feature: dict, ranges: list[tuple[int, int]] | None, counts: TokenCounts, *, longest_first: bool = False
) -> None:
    """Add a column's real and processed token positions to ``counts``, as device tensors.

    Args:
        feature: the column's features; counted from ``attention_mask`` of shape ``(rows, seq_len)``
            (right padding), skipped without one.
        ranges: the ``(begin, end)`` row ranges of its mini-batches
            (:func:`cembed.losses.length_sorted.minibatch_ranges`), or None for one forward over the
            whole column.
        counts: the counter to add to.
        longest_first: the rows are sorted by length, longest first, so a mini-batch's padded width
            is its first row's length (one strided view or one gather instead of a max per range).

    sentence-transformers trims each mini-batch to its longest row (``_create_minibatch``), so a
    mini-batch processes ``rows x longest row`` positions. Nothing here reads a tensor on the host:
    regular ranges (``mini_batch_size``) are views and reshapes of the lengths; irregular ones
    (``mini_batch_num_tokens``) go to the device by a non-blocking copy.
    """
    mask = feature.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[0] == 0:
        return
    lengths = mask.sum(dim=1, dtype=torch.int64)
    n = lengths.shape[0]
    if ranges is None:  # one forward over the whole column, padded to its longest row
        processed = n * lengths.amax()
    else:
        size = ranges[0][1] - ranges[0][0]
        if all(end - begin == size for begin, end in ranges[:-1]):  # mini_batch_size: k ranges of `size`
            missing = size * len(ranges) - n  # rows the last range lacks
            if longest_first:
                widths = lengths[::size]
            else:
                widths = torch.nn.functional.pad(lengths, (0, missing)).view(len(ranges), size).amax(dim=1)
            processed = size * widths.sum() - missing * widths[-1]
        else:
            sizes = _to_device([end - begin for begin, end in ranges], lengths.device)
            if longest_first:
                widths = lengths[_to_device([begin for begin, _ in ranges], lengths.device)]
            else:
                segment = torch.repeat_interleave(
                    torch.arange(len(ranges), device=lengths.device), sizes, output_size=n
                )
                widths = torch.zeros(len(ranges), dtype=torch.int64, device=lengths.device)
                widths = widths.scatter_reduce(0, segment, lengths, "amax")
            processed = (widths * sizes).sum()
    counts.add(lengths.sum(), processed, (lengths * lengths).sum())
