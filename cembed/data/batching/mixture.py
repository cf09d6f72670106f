"""Several training sources in one run: which source each batch comes from.

Every batch holds rows of one source only (BGE-M3's and nomic-embed's "same dataset within a
batch": in-batch negatives from another source are too easy). The sources' batches are built
separately (:class:`cembed.data.batching.full_table.NoDuplicatesSampler`), then laid out by a schedule:

- ``proportional`` (default): every source's batches once per epoch, so each source's share of the
  steps is its share of the batches (its rows / batch size, less rows the no-duplicates rule leaves
  out); sentence-transformers' ``ProportionalBatchSampler`` takes the same batches in a random order.
- ``round_robin``: one batch of each source in turn, whole rounds until one runs out (as
  sentence-transformers' ``RoundRobinBatchSampler``): every source gets the same number of batches.
- ``weighted``: shares of the batches by ``data.sampling.weights``, until a source runs out.

The last two leave the other sources' remaining rows unused each epoch;
:func:`cembed.data.batching.placement.schedule_warnings` says how many, from the epoch plan the sampler
trains on (:func:`cembed.data.batching.full_table.plan_epoch`).

The schedule is deterministic and smooth: batch ``t`` goes to the source furthest behind its share
(largest ``t x share - batches taken``, ties to the first source), so with two sources every prefix
of the epoch, not only the whole epoch, is within one batch of the shares. It depends only on the
number of batches each source has, so every rank computes the same schedule, the global batch of a
step is one source on every rank, and a resumed run replays it.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

STRATEGIES = ("proportional", "round_robin", "weighted")


@dataclass(frozen=True)
class SourceMix:
    """The sources of a concatenated dataset and how batches are drawn from them.

    ``sizes[i]`` rows of source ``names[i]`` follow the previous sources' rows in the dataset.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    strategy: str = "proportional"
    weights: tuple[float, ...] | None = None  # per source, for strategy weighted

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: one of {', '.join(STRATEGIES)}")
        if len(self.names) != len(self.sizes) or (self.weights is not None and len(self.weights) != len(self.names)):
            raise ValueError("names, sizes and weights need one entry per source")
        if self.strategy == "weighted" and self.weights is None:
            raise ValueError("strategy weighted needs weights")

    @classmethod
    def from_data(cls, data, sampling) -> SourceMix:
        """The mix of a :class:`cembed.data.rows.TrainingData` under ``data.sampling``
        (:class:`cembed.config.data.SamplingConfig`): weights are looked up by source name."""
        names = tuple(s.name for s in data.sources) or ("data",)
        strategy = sampling.resolved_strategy
        weights = tuple(float(sampling.weights[n]) for n in names) if strategy == "weighted" else None
        return cls(names, tuple(data.source_sizes()), strategy, weights)

    @property
    def offsets(self) -> list[int]:
        """First row of each source in the dataset."""
        out, at = [], 0
        for size in self.sizes:
            out.append(at)
            at += size
        return out

    def schedule(self, available: list[int]) -> list[int]:
        """The source of each batch of an epoch, given each source's ``available`` batches."""
        if self.strategy == "proportional":
            return interleave(available, available, stop_when_short=False)
        if self.strategy == "round_robin":  # whole rounds: every source the same number of batches
            return list(range(len(available))) * min(available, default=0)
        return interleave(available, list(self.weights), stop_when_short=True)


def interleave(available: list[int], shares: list[float], stop_when_short: bool) -> list[int]:
    """A smooth schedule of source indices: step ``t`` (from 1) goes to the source ``i`` with the
    largest ``t x shares[i] / sum(shares) - taken[i]`` (exact fractions; ties to the lowest index).

    Args:
        available: batches each source has this epoch.
        shares: each source's share (any positive numbers; only their ratios count).
        stop_when_short: end the epoch at the first step whose source has no batch left
            (round_robin, weighted); otherwise sources without batches are passed over until all
            are used (proportional).

    Returns:
        One source index per batch; ``taken[i] <= available[i]``.
    """
    fractions = [Fraction(s) for s in shares]
    total = sum(fractions)
    taken = [0] * len(available)
    out: list[int] = []
    step = 0
    while True:
        step += 1
        candidates = [i for i in range(len(available)) if stop_when_short or taken[i] < available[i]]
        if not candidates:
            return out
        best = max(candidates, key=lambda i: (step * fractions[i] / total - taken[i], -i))
        if taken[best] >= available[best]:
            return out
        taken[best] += 1
        out.append(best)
