"""cembed.data.batching.mixture: the source schedule of an epoch, batch by batch, for given batch counts and
weights (every expectation worked out by hand from the "furthest behind its share" rule)."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest

from cembed.config.data import SamplingConfig
from cembed.data.batching.mixture import SourceMix, interleave


def test_proportional_every_batch_once_in_smooth_order():
    # shares 3/4, 1/4: t=1 (.75 vs .25) -> a; t=2 (.5 vs .5, tie) -> a; t=3 (.25 vs .75) -> b; t=4 -> a
    assert SourceMix(("a", "b"), (30, 10)).schedule([3, 1]) == [0, 0, 1, 0]
    seq = SourceMix(("a", "b", "c"), (1, 1, 1)).schedule([2, 0, 3])
    assert seq == [2, 0, 2, 0, 2]  # c (3/5) first, then a (2/5 - 0 > 6/5 - 1 = 1/5), c, a, c; b has none
    assert [seq.count(i) for i in range(3)] == [2, 0, 3]


def test_proportional_passes_over_an_exhausted_source():
    # a: 1 batch, b: 3; once a's batch is used b takes the rest (not cut short like weighted)
    assert SourceMix(("a", "b"), (1, 1)).schedule([1, 3]) == [1, 0, 1, 1]


def test_round_robin_whole_rounds_only():
    mix = SourceMix(("a", "b", "c"), (5, 5, 5), "round_robin")
    assert mix.schedule([3, 2, 4]) == [0, 1, 2, 0, 1, 2]
    assert mix.schedule([3, 0, 4]) == []  # a source without batches: no whole round
    assert SourceMix(("a",), (5,), "round_robin").schedule([]) == []


def test_weighted_shares_and_stop_at_first_short_source():
    mix = SourceMix(("a", "b"), (1, 1), "weighted", (3.0, 1.0))
    seq = mix.schedule([10, 10])
    # period 4: a a b a; after 12 steps a has 9, b 3; t=13 -> a (10th); t=14 wants a again: none left, stop
    assert seq == [0, 0, 1, 0] * 3 + [0]
    assert (seq.count(0), seq.count(1)) == (10, 3)
    # equal weights, b has 2 batches: a b a b a, then b's turn finds it empty and the epoch ends
    assert SourceMix(("a", "b"), (1, 1), "weighted", (1.0, 1.0)).schedule([5, 2]) == [0, 1, 0, 1, 0]


def test_only_weight_ratios_count():
    a = interleave([6, 6, 6], [1, 2, 3], stop_when_short=True)
    b = interleave([6, 6, 6], [0.5, 1.0, 1.5], stop_when_short=True)
    assert a == b == [2, 1, 0, 2, 1, 2, 2, 1, 0, 2, 1, 2]  # t=1: shares 1/6, 2/6, 3/6 -> c ...


def test_every_prefix_within_one_batch_of_the_shares():
    shares = [Fraction(2), Fraction(5)]
    seq = interleave([40, 100], shares, stop_when_short=True)
    taken = [0, 0]
    for t, src in enumerate(seq, start=1):
        taken[src] += 1
        for i in range(2):
            assert abs(t * shares[i] / sum(shares) - taken[i]) <= 1


def test_offsets_and_from_data():
    data = SimpleNamespace(
        sources=[SimpleNamespace(name="nli"), SimpleNamespace(name="qa")], source_sizes=lambda: [7, 5]
    )
    mix = SourceMix.from_data(data, SamplingConfig(weights={"qa": 1.0, "nli": 4.0}))
    assert mix == SourceMix(("nli", "qa"), (7, 5), "weighted", (4.0, 1.0))
    assert mix.offsets == [0, 7]
    one = SourceMix.from_data(SimpleNamespace(sources=[], source_sizes=lambda: [9]), SamplingConfig())
    assert (one.names, one.strategy, one.weights, one.offsets) == (("data",), "proportional", None, [0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"strategy": "random"}, "strategy 'random'"),
        ({"sizes": (1,)}, "one entry per source"),
        ({"strategy": "weighted", "weights": (1.0,)}, "one entry per source"),
        ({"strategy": "weighted"}, "needs weights"),
    ],
)
def test_invalid_mix_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SourceMix(**{"names": ("a", "b"), "sizes": (1, 2), **kwargs})
