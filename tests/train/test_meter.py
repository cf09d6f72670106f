"""cembed.train.meter: the throughput numbers of a hand-made sequence of steps on a fake clock:
data-wait share, tokens/s, padded share, FLOP/s and MFU (achieved FLOP/s over the peak), per
interval and for the run, on one rank and over two; the masked share; the smoothing of the plot;
the step clock behind the progress line's ETA and samples/s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import cembed.train.meter as meter_module
from cembed.losses.counts import FilterCounts, TokenCounts
from cembed.train.flops import FlopModel
from cembed.train.meter import StepClock, ThroughputMeter, format_eta, smooth

# N = 1000 non-embedding parameters, L = 2 layers, d = 8, a cached loss (4 passes), a 10 MFLOP/s peak:
# flops(sum l, sum l^2) = 4 x (2 x 1000 x sum l + 4 x 2 x 8 x sum l^2) = 8000 sum l + 256 sum l^2
FLOPS = FlopModel(non_embedding_params=1000, layers=2, attention_width=8, passes=4, peak_flops=1e7, peak_source="x")


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock(100.0)
    monkeypatch.setattr(meter_module, "time", SimpleNamespace(perf_counter=clock))  # the meter's clock only
    return clock


def _two_intervals(meter: ThroughputMeter, clock: Clock) -> tuple[dict, dict]:
    meter.start()  # t = 100
    meter.waited(0.5)
    meter.waited(1.5)
    # device tensors, as the loss leaves them: 300 real of 400 positions, sum l^2 = 30000
    meter.token_counts.add(torch.tensor(200), torch.tensor(250), torch.tensor(20000))
    meter.token_counts.add(torch.tensor(100), torch.tensor(150), torch.tensor(10000))
    clock.now = 110.0
    first = meter.snapshot(step=10)
    meter.waited(1.0)
    meter.token_counts.add(100, 100, 10000)
    clock.now = 130.0
    second = meter.snapshot(step=20)
    return first, second


def test_intervals_and_totals_one_rank(clock):
    meter = ThroughputMeter(TokenCounts(), FLOPS)
    first, second = _two_intervals(meter, clock)
    # 10 s, 2 s waited, 300 of 400 positions real; 8000 x 300 + 256 x 30000 = 10.08 MFLOP in 10 s
    assert first == {
        "data_wait": 0.2,
        "tokens_per_s": 30.0,
        "padded_share": 0.25,
        "flops_per_s": 1008000.0,
        "mfu": 0.1008,
    }
    # 20 s, 1 s waited, 100 of 100 real; 8000 x 100 + 256 x 10000 = 3.36 MFLOP in 20 s
    assert second == {
        "data_wait": 0.05,
        "tokens_per_s": 5.0,
        "padded_share": 0.0,
        "flops_per_s": 168000.0,
        "mfu": 0.0168,
    }
    assert [h["step"] for h in meter.history] == [10, 20]
    assert meter.token_counts.read() == (0, 0, 0)  # read and reset at every interval
    totals = meter.finish()
    # the run: 30 s, 3 s waited, 400 of 500 real, 8000 x 400 + 256 x 40000 = 13.44 MFLOP
    assert {k: v for k, v in totals.items() if k != "flop_model"} == {
        "data_wait": 0.1,
        "tokens_per_s": 13.3,
        "padded_share": 0.2,
        "flops_per_s": 448000.0,
        "mfu": 0.0448,
    }
    assert totals["flop_model"]["non_embedding_params"] == 1000 and "formula" in totals["flop_model"]
    clock.now = 1000.0  # saving and evaluating after training do not dilute the closed totals
    meter.waited(50.0)
    assert meter.totals() == totals


def test_without_flop_model_or_peak(clock):
    meter = ThroughputMeter(TokenCounts())
    first, _ = _two_intervals(meter, clock)
    assert first == {"data_wait": 0.2, "tokens_per_s": 30.0, "padded_share": 0.25}
    cpu = FlopModel(1000, 2, 8, 4)  # no peak (CPU): FLOP/s still, MFU None
    meter = ThroughputMeter(TokenCounts(), cpu)
    clock.now = 100.0
    first, _ = _two_intervals(meter, clock)
    assert first["flops_per_s"] == 1008000.0 and first["mfu"] is None


def test_two_ranks_summed_and_averaged(clock):
    # the peer rank: 100 real of 200 positions, 5 s waited of 10 s, sum l^2 = 0 (800 kFLOP)
    peer = [100, 200, 5.0, 10.0, 0, 0]
    meter = ThroughputMeter(TokenCounts(), FLOPS, gather=lambda values: [list(values), peer])
    meter.start()
    meter.waited(2.0)
    meter.token_counts.add(300, 400, 30000)
    clock.now = 110.0
    stats = meter.snapshot(step=5)
    # tokens/s 30 + 10; data wait mean(0.2, 0.5); padding 1 - 400/600; FLOP/s 1008000 + 80000 over 2 peaks
    assert stats == {
        "data_wait": 0.35,
        "tokens_per_s": 40.0,
        "padded_share": 0.3333,
        "flops_per_s": 1088000.0,
        "mfu": 0.0544,
    }
    totals = meter.totals()
    assert totals["ranks"] == 2
    assert totals["per_rank"] == [
        {"tokens_per_s": 30.0, "data_wait": 0.2, "flops_per_s": 1008000.0},
        {"tokens_per_s": 10.0, "data_wait": 0.5, "flops_per_s": 80000.0},
    ]


def test_masked_share_per_interval_and_run(clock):
    counts = FilterCounts()
    meter = ThroughputMeter(TokenCounts(), filter_counts=counts)
    meter.start()
    counts.masked, counts.candidates = 3, 40
    meter.token_counts.add(10, 10, 100)
    clock.now = 101.0
    assert meter.snapshot(step=1)["masked_share"] == 0.075
    assert (counts.masked, counts.candidates) == (0, 0)  # reset per interval
    counts.masked, counts.candidates = 1, 60  # not yet snapshotted: still in the run's totals
    totals = meter.totals()
    assert (totals["masked"], totals["candidates"], totals["masked_share"]) == (4, 100, 0.04)


def test_smooth():
    assert smooth([1.0, 2.0, 3.0, 4.0, 5.0], window=3) == [1.5, 2.0, 3.0, 4.0, 4.5]  # ends: shorter windows
    assert smooth([4.0, 0.0, 8.0]) == [4.0, 0.0, 8.0]  # default window for 3 points: 1
    values = [float(i % 2) for i in range(100)]  # default window 10, half 5: points 45..55, six of them odd
    assert smooth(values)[50] == pytest.approx(6 / 11)
    assert smooth([]) == []


# --- the step clock: ETA and samples/s of the progress line ---------------------------------------


def test_eta_from_the_first_step_however_long_it_takes():
    """A huge batch: 45 s a step (rich's estimate needs two updates within 30 s: none at all)."""
    clock = Clock(1000.0)
    steps = StepClock(clock=clock)
    steps.begin(0)
    assert steps.eta(40) is None  # nothing timed yet
    clock.now += 45.0
    steps.step_ended(1)
    assert steps.eta(40) == 39 * 45.0
    clock.now += 10.0  # 10 s into step 2: the ETA counts down between updates ...
    assert steps.eta(40) == 39 * 45.0 - 10.0
    clock.now += 100.0  # ... but never below the steps left after this one
    assert steps.eta(40) == 38 * 45.0
    assert format_eta(steps.eta(40)) == "0:28:30"


def test_seconds_per_step_mean_first_then_moving_average():
    clock = Clock(0.0)
    steps = StepClock(smoothing=0.5, clock=clock)
    steps.begin(0)
    for step, seconds in ((1, 30.0), (2, 10.0)):
        clock.now += seconds
        steps.step_ended(step)
    assert steps.seconds_per_step == 20.0  # the mean of the first 1/smoothing = 2 steps
    clock.now += 40.0
    steps.step_ended(3)
    assert steps.seconds_per_step == 30.0  # then 20 + 0.5 x (40 - 20)
    clock.now += 20.0
    steps.step_ended(5)  # two steps at once, 10 s each: 30 + 0.5 x (10 - 30)
    assert steps.seconds_per_step == 20.0
    assert steps.eta(5) == 0.0 and steps.eta(8) == 60.0


def test_samples_per_s_counts_only_this_process_steps():
    """A resume at step 20 of 40 (8 samples a step), then 2 steps of 10 s: 16 samples in 20 s, not
    the 176 the global step implies."""
    clock = Clock(500.0)
    steps = StepClock(clock=clock)
    steps.begin(20)
    assert steps.samples_per_s(8) == 0.0
    for step in (21, 22):
        clock.now += 10.0
        steps.step_ended(step)
    clock.now += 5.0  # the rate is taken at the last step's end, not now
    assert steps.samples_per_s(8) == pytest.approx(0.8)
    assert steps.eta(40) == pytest.approx(18 * 10.0 - 5.0)


def test_format_eta():
    assert [format_eta(s) for s in (None, 0.4, 59.6, 3600 * 5 + 61, 86400 * 2 + 3599)] == [
        "-:--:--",
        "0:00:00",
        "0:01:00",
        "5:01:01",
        "2d 0:59:59",
    ]
