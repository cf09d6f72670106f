"""Throughput meter: how long training waited for data, tokens/s, and the padded share.

Per logging interval (the trainer's ``logging_steps``):

- ``data_wait``: share of the interval's wall time the training loop spent waiting for its next
  batch (sampling, fetching and collating, when not hidden by dataloader workers);
- ``tokens_per_s``: non-padding tokens embedded per second (each text counted once per step);
- ``padded_share``: share of the token positions the encoder processed that were padding;
- with a :class:`~cembed.train.flops.FlopModel`: ``flops_per_s``, the model FLOPs of the real tokens per
  second, with a late-interaction loss's MaxSim scoring (the (query token, document token) pairs it
  scored, :attr:`cembed.losses.counts.TokenCounts.scored_pairs`; formula and sources in
  :mod:`cembed.train.flops`), and ``mfu``, that over the device's dense peak (None without a known
  peak, e.g. on a CPU).

The loss keeps its token counts as device tensors (:class:`~cembed.losses.counts.TokenCounts`); the meter
reads them once per interval, so counting adds no host-device synchronisation per mini-batch.

- ``masked_share`` (with a false-negative filter, :class:`cembed.losses.counts.FilterCounts`): share
  of the in-batch candidates left out of the softmax as likely false negatives (summed over ranks).

With several processes (``gather``: one all-gather per logging interval, on every rank at the same
step) the statistics are the job's: tokens/s summed over the ranks (each rank's tokens over its
own wall time), data-wait the mean of the ranks' shares, padding over all ranks' positions, FLOP/s
summed like tokens/s and MFU over the sum of the ranks' peaks (one device per rank); the run's totals also list each rank's own (``per_rank``). The totals are closed when training ends
(:meth:`ThroughputMeter.finish`), so saving and evaluating afterwards do not dilute them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cembed.files import write_atomic
from cembed.losses.counts import FilterCounts, TokenCounts
from cembed.train.flops import FlopModel


def _combine(rows: list[list[float]], flops: FlopModel | None = None) -> dict:
    """Per-rank ``[real, processed, wait, wall, real_sq, scored_pairs]`` rows -> the job's statistics and
    each rank's own (with ``flops``: also FLOP/s and MFU)."""
    per_rank = []
    for real, _, wait, wall, real_sq, pairs in rows:
        wall = max(wall, 1e-9)
        rank = {"tokens_per_s": real / wall, "data_wait": wait / wall}
        if flops is not None:
            rank["flops_per_s"] = flops.flops(real, real_sq, pairs) / wall
        per_rank.append(rank)
    real, processed = sum(r[0] for r in rows), sum(r[1] for r in rows)
    out = {
        "data_wait": round(sum(r["data_wait"] for r in per_rank) / len(rows), 4),
        "tokens_per_s": round(sum(r["tokens_per_s"] for r in per_rank), 1),
        "padded_share": round(1 - real / processed, 4) if processed else 0.0,
    }
    if flops is not None:
        flops_per_s = sum(r["flops_per_s"] for r in per_rank)
        out["flops_per_s"] = round(flops_per_s, 1)
        out["mfu"] = round(flops_per_s / (flops.peak_flops * len(rows)), 6) if flops.peak_flops else None
    out["per_rank"] = [{k: round(v, 4 if k == "data_wait" else 1) for k, v in r.items()} for r in per_rank]
    return out


def _local(values: list[float]) -> list[list[float]]:
    return [list(values)]


@dataclass
class ThroughputMeter:
    """Times data waits and counts tokens per logging interval and for the whole run.

    Attributes:
        token_counts: the loss's token counter (read and reset at every interval).
        flops: the run's FLOP model (adds ``flops_per_s`` and ``mfu``); None: no FLOP statistics.
        gather: ``values -> every rank's values`` (e.g. :func:`cembed.distributed.collectives.gather_over_ranks`);
            the default is this process alone.
    """

    token_counts: TokenCounts
    flops: FlopModel | None = None
    gather: Callable[[list[float]], list[list[float]]] = _local
    filter_counts: FilterCounts | None = None  # the loss's false-negative filter counts, if it filters
    total_masked: int = 0
    total_candidates: int = 0
    history: list[dict] = field(default_factory=list)
    total_wait: float = 0.0
    total_real: int = 0
    total_processed: int = 0
    total_real_sq: int = 0
    total_scored_pairs: int = 0
    _wait: float = 0.0
    _start: float = field(default_factory=time.perf_counter)
    _first: float | None = None
    _final: dict | None = None

    def start(self) -> None:
        """Start the first interval (call when training begins)."""
        self._start = self._first = time.perf_counter()
        self._wait = 0.0
        self.token_counts.reset()
        if self.filter_counts is not None:
            self.filter_counts.reset()

    def _masked_share(self, masked: int, candidates: int) -> dict:
        """``{"masked_share": ...}`` over every rank's candidates (one gather), or ``{}`` without a filter."""
        if self.filter_counts is None:
            return {}
        rows = self.gather([masked, candidates])
        masked, candidates = sum(r[0] for r in rows), sum(r[1] for r in rows)
        return {"masked_share": round(masked / candidates, 6) if candidates else 0.0}

    def waited(self, seconds: float) -> None:
        """Record ``seconds`` spent waiting for a batch."""
        self._wait += seconds
        self.total_wait += seconds

    def snapshot(self, step: int) -> dict[str, float]:
        """Close the current interval: the job's ``data_wait``, ``tokens_per_s`` and ``padded_share``,
        with a FLOP model also ``flops_per_s`` and ``mfu`` (every rank must call it at the same step
        when ``gather`` is collective). Reads the loss's token counts: one host read per interval."""
        now = time.perf_counter()
        wall = max(now - self._start, 1e-9)
        real, processed, real_sq = self.token_counts.read()
        pairs = self.token_counts.scored_pairs
        stats = _combine(self.gather([real, processed, self._wait, wall, real_sq, pairs]), self.flops)
        del stats["per_rank"]
        if self.filter_counts is not None:
            fc = self.filter_counts
            stats.update(self._masked_share(fc.masked, fc.candidates))
            self.total_masked += fc.masked
            self.total_candidates += fc.candidates
            fc.reset()
        self.total_real += real
        self.total_processed += processed
        self.total_real_sq += real_sq
        self.total_scored_pairs += pairs
        self.history.append({"step": step, **stats})
        self._start, self._wait = now, 0.0
        self.token_counts.reset()
        return stats

    def finish(self) -> dict:
        """Close the run's totals (call on every rank when training ends) and return them."""
        self._final = None
        self._final = self.totals()
        return self._final

    def totals(self) -> dict:
        """Whole-run ``data_wait`` share, ``tokens_per_s`` and ``padded_share`` of the job (with a
        FLOP model also ``flops_per_s``, ``mfu`` and ``flop_model``, its constants), and with
        several ranks ``ranks`` and ``per_rank`` (each rank's own); after :meth:`finish` the closed
        totals (no collective), before it a gather like :meth:`snapshot`'s."""
        if self._final is not None:
            return self._final
        wall = max(time.perf_counter() - (self._first or self._start), 1e-9)
        real, processed, real_sq = self.token_counts.read()
        row = [self.total_real + real, self.total_processed + processed, self.total_wait, wall]
        pairs = self.total_scored_pairs + self.token_counts.scored_pairs
        rows = self.gather([*row, self.total_real_sq + real_sq, pairs])
        out = _combine(rows, self.flops)
        if self.filter_counts is not None:
            masked = self.total_masked + self.filter_counts.masked
            candidates = self.total_candidates + self.filter_counts.candidates
            out.update(self._masked_share(masked, candidates), masked=masked, candidates=candidates)
        if len(rows) > 1:
            out["ranks"] = len(rows)
        else:
            del out["per_rank"]
        if self.flops is not None:
            out["flop_model"] = self.flops.to_dict()
        return out


@dataclass
class StepClock:
    """Wall time per optimizer step in this process: the ETA and the samples/s of the progress line.

    Every step is timed from the end of the one before (the first from :meth:`begin`), so the time
    between steps (evaluation, checkpoint saves) counts too. The estimate of seconds per step is
    the mean of the steps timed so far until ``1 / smoothing`` of them are, then an exponential
    moving average with weight ``smoothing`` on the newest: it exists from the first step on, however
    long a step takes (rich's own estimate needs two updates within 30 s and shows ``-:--:--`` for
    the long steps of huge batches), and follows a run that speeds up or slows down.

    The rate counts only the steps this process trained (a resumed run starts at the checkpoint's
    step, :attr:`start_step`) over this process's wall time since :meth:`begin`.

    Attributes:
        smoothing: EMA weight of the newest step, in (0, 1].
        clock: seconds, monotonic (tests pass a fake one).
    """

    smoothing: float = 0.2
    clock: Callable[[], float] = time.perf_counter
    start_step: int = 0
    started: float | None = None
    last_step: int = 0
    last_end: float | None = None
    seconds_per_step: float | None = None
    timed: int = 0

    def begin(self, step: int) -> None:
        """Training starts (or resumes) in this process at optimizer step ``step``."""
        self.started = self.last_end = self.clock()
        self.start_step = self.last_step = step
        self.seconds_per_step, self.timed = None, 0

    def step_ended(self, step: int) -> None:
        """Optimizer step ``step`` ended: fold its wall time into the estimate (several steps at once,
        ``step - last_step``, share the time between them)."""
        if self.last_end is None:
            self.begin(step - 1)
        n = step - self.last_step
        if n <= 0:
            return
        now = self.clock()
        per_step = (now - self.last_end) / n
        self.timed += n
        weight = max(self.smoothing, n / self.timed)  # the plain mean over the first 1/smoothing steps
        estimate = self.seconds_per_step
        self.seconds_per_step = per_step if estimate is None else estimate + weight * (per_step - estimate)
        self.last_step, self.last_end = step, now

    def eta(self, max_steps: int) -> float | None:
        """Seconds until step ``max_steps`` ends: the estimate times the steps left, less the time
        already spent in the current step (at most one step's estimate, so the ETA counts down
        between updates and never claims the current step is over); None before a step was timed."""
        if self.seconds_per_step is None or self.last_end is None:
            return None
        left = max_steps - self.last_step
        if left <= 0:
            return 0.0
        into_step = min(max(self.clock() - self.last_end, 0.0), self.seconds_per_step)
        return left * self.seconds_per_step - into_step

    def samples_per_s(self, samples_per_step: int) -> float:
        """Samples per second this process trained: its steps x ``samples_per_step`` over its wall
        time up to the end of its last step (0.0 before a step ended)."""
        if self.started is None or self.last_end is None or self.last_end <= self.started:
            return 0.0
        return (self.last_step - self.start_step) * samples_per_step / (self.last_end - self.started)


def format_eta(seconds: float | None) -> str:
    """``H:MM:SS`` (days as ``Nd H:MM:SS``); ``-:--:--`` for None (no step timed yet)."""
    if seconds is None:
        return "-:--:--"
    whole = int(round(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    text = f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


def smooth(values: list[float], window: int | None = None) -> list[float]:
    """Centered moving average of ``values`` (shorter windows at the ends). ``window`` defaults to
    about a tenth of the run (at least 1, at most 51 points)."""
    n = len(values)
    if window is None:
        window = min(51, max(1, n // 10))
    half = max(window, 1) // 2
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    return [
        (prefix[min(n, i + half + 1)] - prefix[max(0, i - half)]) / (min(n, i + half + 1) - max(0, i - half))
        for i in range(n)
    ]


def plot_run(
    losses: list[tuple[int, float]],
    meter_history: list[dict],
    samples_per_step: int,
    path: str | Path,
    step_losses: list[tuple[int, float]] | None = None,
    title: str | None = None,
) -> Path | None:
    """Write a PNG with loss, throughput (tokens/s), data-wait share and, when the meter has a FLOP
    model, achieved TFLOP/s (with MFU % on a second axis when the device has a peak) against the step.
    ``title`` (e.g. the run folder and the model) heads the figure; step ticks are whole numbers; the
    data-wait axis runs from 0 to at least 1 % (a share of 0.01 % drawn on a 0-0.02 % axis would
    look like a problem).

    The loss panel shows every optimizer step's loss (``step_losses``) as points with a smoothed
    line over them, and the logged interval means (``losses``) as markers; without
    ``step_losses`` only the logged losses are drawn.

    Returns the path, or ``None`` when there is nothing to plot.
    """
    if not losses and not meter_history and not step_losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    with_flops = any("flops_per_s" in h for h in meter_history)
    fig, axes = plt.subplots(4 if with_flops else 3, 1, figsize=(7, 9 if with_flops else 7), sharex=True)
    if step_losses:
        steps, values = [s for s, _ in step_losses], [v for _, v in step_losses]
        axes[0].plot(steps, values, ".", color="tab:blue", alpha=0.3, markersize=4, label="every step")
        axes[0].plot(steps, smooth(values), color="tab:blue", label="smoothed")
        if losses:
            axes[0].plot(
                [s for s, _ in losses],
                [v for _, v in losses],
                "o",
                color="tab:orange",
                markersize=4,
                label="logged (interval mean)",
            )
        axes[0].legend(loc="upper right", fontsize="small")
    elif losses:
        axes[0].plot([s for s, _ in losses], [v for _, v in losses], marker=".")
    axes[0].set_ylabel("loss")
    steps = [h["step"] for h in meter_history]
    axes[1].plot(steps, [h["tokens_per_s"] for h in meter_history], marker=".", color="tab:green")
    axes[1].set_ylabel("tokens/s")
    axes[2].plot(steps, [100 * h["data_wait"] for h in meter_history], marker=".", color="tab:red")
    axes[2].set_ylabel("data-wait %")
    wait_top = max((100 * h["data_wait"] for h in meter_history), default=0.0)
    axes[2].set_ylim(0, max(1.0, 1.2 * wait_top))
    if with_flops:
        axes[3].plot(steps, [h.get("flops_per_s", 0.0) / 1e12 for h in meter_history], marker=".", color="tab:purple")
        axes[3].set_ylabel("model TFLOP/s")
        mfu = [(s, 100 * h["mfu"]) for s, h in zip(steps, meter_history) if h.get("mfu") is not None]
        if mfu:
            twin = axes[3].twinx()
            twin.plot([s for s, _ in mfu], [v for _, v in mfu], ".", color="tab:gray", markersize=3)
            twin.set_ylabel("MFU %")
    axes[-1].set_xlabel(f"optimizer step ({samples_per_step} samples each)")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # shared x: every panel's steps
    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100), binary=True)
    plt.close(fig)
    return path
