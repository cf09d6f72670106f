"""``cembed probe-minibatch``: the largest ``mini_batch_size`` whose cached-loss training step fits.

With the cached loss (GradCache) ``mini_batch_size`` is the only setting that decides memory. The
probe measures it in the worst case instead of guessing:

* :func:`search_mini_batch` is the search, a pure function over a *trial* callable
  (``size -> TrialOutcome``) so it is testable with fakes: double from a small size until a trial
  fails, then bisect between the last success and the first failure. Every size it returns was run.
  A trial "fits" when it ran and its measured peak stays under ``(1 - margin)`` of the capacity.
* :mod:`cembed.probe.trials` holds the trials: :func:`~cembed.probe.worst_case.worst_case_step` (one
  worst-case cached-loss step) and the runners that measure its peak memory, in this process on
  CUDA (:class:`~cembed.probe.trials.CudaTrial`) or in a child process
  (:class:`~cembed.probe.trials.SubprocessTrial`).
* :func:`probe_token_budget` turns the answer into a token budget (``batch.mini_batch_num_tokens``,
  :mod:`cembed.losses.token_budget`): rows x tokens per row of the worst case, confirmed by a trial run at
  that budget.
* :mod:`cembed.probe.setup` says what the trials measured (precision, LoRA, checkpointing, FSDP).
* :mod:`cembed.probe.auto` runs a probe: :func:`~cembed.probe.auto.run_probe` picks the runner and
  the budget; :func:`~cembed.probe.auto.resolve_auto` fills ``batch.mini_batch_size: auto`` (and the
  token budget).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from cembed.errors import UserError
from cembed.files import format_bytes
from cembed.probe.trials import TrialOutcome, describe_failure, is_device_failure

DEFAULT_MARGIN = 0.10  # headroom fraction of the device's memory
DEFAULT_CAP = 65536
KNEE_FRACTION = 0.95
START_SIZE = 8


# ----------------------------------------------------------------------------------------------
# The search (pure)


@dataclass
class TrialRecord:
    """One tried size, in the order it was tried."""

    size: int
    fits: bool
    peak_bytes: int | None
    samples_per_s: float | None
    error: str | None = None
    num_tokens: int | None = None  # the token budget the trial ran at (None: ``size`` rows)
    tokens_per_row: int | None = None  # every row's width in the trial, tokens


@dataclass
class ProbeResult:
    """The outcome of a search.

    Attributes:
        recommended: the ``mini_batch_size`` to use (a size that was run and fit).
        max_fit: the largest tried size that fit (>= ``recommended``).
        reason: one line saying why ``recommended`` was chosen.
        capacity_bytes, margin, limit_bytes: the memory the device has, the headroom fraction and
            ``(1 - margin) * capacity``, the most a fitting trial may use.
        cap: the largest size the search was allowed to try.
        trials: every tried size, in order.
        cuda_context_lost: a sticky CUDA error poisoned this process's context during the probe
            (the answer stands, measured in child processes; this process cannot train on the GPU).
        world_size: ranks whose gathered candidates the trials' loss stage scored (1: no gathering).
        ranks: per rank (in a process group; else this process alone): ``rank``, the size it found
            (``recommended``), its measured peak at that size (``peak_bytes``) and ``limit_bytes``.
        tokens_per_row: the trials' row width (``max_seq_length``), tokens.
        recommended_num_tokens: the token budget to use, ``recommended x tokens_per_row`` (its trial
            fit); None when not probed or its trial did not fit.
        max_fit_num_tokens: the largest budget that fits in the worst case, ``max_fit x
            tokens_per_row`` (every budget below ``(max_fit + 1) x tokens_per_row`` cuts the same
            mini-batches of full-length rows).
        measured: the trials' setup (:func:`cembed.probe.setup.trial_setup`) with ``strategy``, ``ranks``.
    """

    recommended: int
    max_fit: int
    reason: str
    capacity_bytes: int
    margin: float
    limit_bytes: int
    cap: int
    trials: list[TrialRecord] = field(default_factory=list)
    device: str = ""
    cuda_context_lost: bool = False
    notes: list[str] = field(default_factory=list)
    world_size: int = 1
    ranks: list[dict] = field(default_factory=list)
    tokens_per_row: int | None = None
    recommended_num_tokens: int | None = None
    max_fit_num_tokens: int | None = None
    measured: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def search_mini_batch(
    trial: Callable[[int], TrialOutcome],
    capacity_bytes: int,
    margin: float = DEFAULT_MARGIN,
    cap: int = DEFAULT_CAP,
    start: int = START_SIZE,
    knee_fraction: float | None = KNEE_FRACTION,
    on_trial: Callable[[TrialRecord], None] | None = None,
) -> ProbeResult:
    """Find the largest size in ``1..cap`` whose trial fits under ``(1 - margin) * capacity_bytes``.

    Doubles from ``min(start, cap)`` until a trial fails (or ``cap`` fits), then bisects between the
    last success and the first failure, so at most about ``2 * log2(cap)`` trials run and every
    returned size was run. A trial fails when it returns an outcome with ``error``, has no or too
    high a peak, or raises a device failure (:func:`is_device_failure`: CUDA out-of-memory and other
    CUDA errors). Among fitting sizes with a measured throughput, the smallest one reaching
    ``knee_fraction`` of the best samples/s is recommended (near the memory edge speed stops
    improving); ``knee_fraction=None`` always recommends the largest fitting size.

    Args:
        trial: ``size -> TrialOutcome``; may raise device failures.
        capacity_bytes: memory of the device (or the CPU budget), bytes.
        margin: headroom fraction in ``[0, 1)``.
        cap: the largest size to try (>= 1).
        start: the first size tried.
        knee_fraction: throughput fraction for the knee rule, or None.
        on_trial: called with each record as soon as it is measured (progress output).

    Returns:
        A :class:`ProbeResult`.

    Raises:
        UserError: even size 1 does not fit.
        Exception: whatever non-device error ``trial`` raises (a bug, not "does not fit").
    """
    if not 0 <= margin < 1:
        raise UserError(f"--margin: must be in [0, 1), got {margin}")
    if cap < 1:
        raise UserError(f"--max: must be at least 1, got {cap}")
    limit = (1 - margin) * capacity_bytes
    records: list[TrialRecord] = []

    def attempt(size: int) -> bool:
        rec = run_trial(trial, size, limit)
        records.append(rec)
        if on_trial is not None:
            on_trial(rec)
        return rec.fits

    lo, hi = 0, None  # largest size known to fit, smallest size known not to
    size = max(1, min(start, cap))
    while True:
        if attempt(size):
            lo = size
            if size >= cap:
                break
            size = min(2 * size, cap)
        else:
            hi = size
            break
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        last = records[-1]
        why = last.error or f"peak {format_bytes(last.peak_bytes)} over the limit {format_bytes(limit)}"
        raise UserError(
            f"batch.mini_batch_size: not even 1 row fits ({why}); lower model.max_seq_length, use "
            "model.precision bf16, or give more memory (--max-memory / --margin)"
        )
    recommended, reason = choose_recommendation(records, lo, knee_fraction)
    return ProbeResult(recommended, lo, reason, int(capacity_bytes), margin, int(limit), cap, records)


def run_trial(
    trial: Callable[..., TrialOutcome], size: int, limit: float, num_tokens: int | None = None
) -> TrialRecord:
    """Run ``trial(size)`` (or ``trial(size, num_tokens=...)``) and judge it against ``limit`` bytes:
    it fits when it ran and its peak is known and at most ``limit``. Device failures
    (:func:`is_device_failure`) count as "does not fit"; any other exception propagates."""
    try:
        out = trial(size) if num_tokens is None else trial(size, num_tokens=num_tokens)
    except Exception as exc:  # noqa: BLE001 - classified just below
        if not is_device_failure(exc):
            raise
        out = TrialOutcome(error=describe_failure(exc))
    fits = out.error is None and out.peak_bytes is not None and out.peak_bytes <= limit
    rows = out.rows if num_tokens is not None and out.rows else size
    return TrialRecord(rows, fits, out.peak_bytes, out.samples_per_s, out.error, num_tokens, out.tokens_per_row)


def probe_token_budget(
    result: ProbeResult, trial: Callable[..., TrialOutcome], on_trial: Callable[[TrialRecord], None] | None = None
) -> ProbeResult:
    """Add the token budget to a finished row search: ``recommended x tokens_per_row`` (the worst
    case's rows are all ``tokens_per_row`` = ``max_seq_length`` tokens wide), run as a trial with
    the loss cutting mini-batches by that budget (:mod:`cembed.losses.token_budget`); it must fit and cut
    ``recommended`` rows. Sets ``tokens_per_row``, ``recommended_num_tokens`` and
    ``max_fit_num_tokens``, appends the trial to ``result.trials`` (with ``num_tokens``), or leaves
    the budget unset with a note when the trials report no row width or the budget's trial fails.

    With a budget of ``B`` tokens a mini-batch holds as many rows as fit ``rows x padded width <= B``,
    so rows shorter than ``tokens_per_row`` travel in larger mini-batches at no more memory: the
    longest rows are the worst case (the budget counts padded positions, see
    :mod:`cembed.losses.token_budget`).

    Returns:
        ``result``, updated in place.
    """
    width = next((r.tokens_per_row for r in result.trials if r.fits and r.tokens_per_row), None)
    if width is None:
        result.notes.append("no token budget: the trials did not report their row width")
        return result
    budget = result.recommended * width
    rec = run_trial(trial, result.recommended, result.limit_bytes, num_tokens=budget)
    result.trials.append(rec)
    if on_trial is not None:
        on_trial(rec)
    if not rec.fits or rec.size != result.recommended:
        why = rec.error or f"{rec.size} rows at peak {format_bytes(rec.peak_bytes)}"
        result.notes.append(f"no token budget: the trial at {budget} tokens did not fit ({why})")
        return result
    result.tokens_per_row = width
    result.recommended_num_tokens = budget
    result.max_fit_num_tokens = result.max_fit * width
    return result


def choose_recommendation(records: list[TrialRecord], max_fit: int, knee_fraction: float | None) -> tuple[int, str]:
    """The knee rule: the smallest fitting size with samples/s >= ``knee_fraction`` x the best
    measured, if it is smaller than ``max_fit``; otherwise ``max_fit``. Returns ``(size, reason)``."""
    default = (max_fit, f"largest size that fits with headroom (largest tried: {max(r.size for r in records)})")
    rated = [r for r in records if r.fits and r.samples_per_s]
    if knee_fraction is None or not rated:
        return default
    best = max(rated, key=lambda r: r.samples_per_s)
    knee = min((r for r in rated if r.samples_per_s >= knee_fraction * best.samples_per_s), key=lambda r: r.size)
    if knee.size >= max_fit:
        return default
    pct = 100 * knee.samples_per_s / best.samples_per_s
    return knee.size, (
        f"throughput knee: {knee.size} reaches {pct:.0f}% of the best measured {best.samples_per_s:.1f} samples/s "
        f"(at {best.size}); larger fitting sizes (up to {max_fit}) are not >{100 * (1 - knee_fraction):.0f}% faster "
        "and use more memory"
    )
