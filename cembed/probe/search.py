"""``cembed probe-minibatch``: the largest ``mini_batch_size`` whose cached-loss training step fits.

With the cached loss (GradCache) ``mini_batch_size`` is the only setting that decides memory. The
probe measures it in the worst case instead of guessing:

* :func:`search_mini_batch` is the search, a pure function over a *trial* callable
  (``size -> TrialOutcome``) so it is testable with fakes: double from a small size until a trial
  fails, then bisect between the last success and the first failure. Every size it returns was run.
  A trial "fits" when it ran and its measured peak stays under ``(1 - margin)`` of the capacity.
* :mod:`cembed.probe.trials` holds the trials: :func:`~cembed.probe.trials.worst_case_step` (one
  worst-case cached-loss step) and the runners that measure its peak memory, in this process on
  CUDA (:class:`~cembed.probe.trials.CudaTrial`) or in a child process
  (:class:`~cembed.probe.trials.SubprocessTrial`).
* :func:`probe_token_budget` turns the answer into a token budget (``batch.mini_batch_num_tokens``,
  :mod:`cembed.losses.token_budget`): rows x tokens per row of the worst case, confirmed by a trial run at
  that budget.
* :mod:`cembed.probe.setup` says what the trials measured (precision, LoRA, checkpointing, FSDP).
* :func:`run_probe` picks the runner and the budget; :func:`resolve_auto` fills
  ``batch.mini_batch_size: auto`` (and the token budget). Both ask the loss config whether it uses
  gradient caching.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Callable

from cembed.distributed.collectives import agree_across_ranks, per_rank_peaks
from cembed.errors import UserError
from cembed.files import parse_bytes  # noqa: F401 - the CLI and callers read sizes through the probe
from cembed.plan.precision import enable_tf32, resolve_device, resolve_precision
from cembed.probe.setup import describe_setup
from cembed.probe.trials import (
    CudaTrial,
    SubprocessTrial,
    TrialOutcome,
    TrialSpec,
    _describe,
    format_bytes,
    is_device_failure,
)

DEFAULT_MARGIN = 0.10
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
        out = TrialOutcome(error=_describe(exc))
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


# ----------------------------------------------------------------------------------------------
# Running a probe


def cpu_capacity() -> int:
    """Physical memory of this machine, bytes (the default CPU budget)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_probe(
    model_cfg,
    loss_cfg,
    batch_size: int,
    n_columns: int = 2,
    device: str = "auto",
    max_size: int = DEFAULT_CAP,
    margin: float = DEFAULT_MARGIN,
    max_memory: int | None = None,
    knee_fraction: float | None = KNEE_FRACTION,
    on_trial: Callable[[TrialRecord], None] | None = None,
    world_size: int = 1,
    sort_by_length: bool = True,
    token_budget: bool = True,
    strategy: str = "ddp",
    ranks: int = 1,
    precision: str | None = None,
) -> ProbeResult:
    """Probe ``mini_batch_size`` for ``model_cfg`` on ``device`` (auto | cpu | cuda), then (with
    ``token_budget``) the token budget ``mini_batch_num_tokens`` (:func:`probe_token_budget`).

    Args:
        model_cfg: a ModelConfig (name_or_path, max_seq_length, precision).
        loss_cfg: a LossConfig; only a loss whose class ``uses_gradient_cache`` has a mini-batch size.
        batch_size: ``per_device_train_batch_size`` (rows); the search cap is ``min(max_size, batch_size)``.
        n_columns: texts per row.
        device: where training would run.
        max_size: ``--max``.
        margin: headroom fraction.
        max_memory: budget in bytes; default: the CUDA device's total memory, or this machine's
            physical memory on CPU.
        knee_fraction: see :func:`search_mini_batch`.
        world_size: ranks whose candidates the loss gathers (training's ``world_size`` with
            ``gather_across_devices``, else 1): the trials' loss stage scores that many.
        sort_by_length: the loss sorts columns by length (its sorted feature copies are measured).
        token_budget: also measure the token budget (one more trial).
        strategy, ranks: ``distributed.strategy`` and the world size: FSDP's sharding is not
            measured (a trial holds the whole model), the result says what it would save.
        precision: the resolved precision training runs in (``Plan.precision`` or
            :func:`cembed.plan.resolve.resolve_model`'s); None resolves ``model_cfg.precision`` for the device.

    Returns:
        The :class:`ProbeResult`, with ``recommended`` (and ``recommended_num_tokens``) agreed
        across ranks (minimum) and every rank's own answer and peak (``ranks``).

    Raises:
        UserError: a plain (uncached) loss, fp16 on CPU (``precision: auto`` is resolved for the
            device as training does, :func:`cembed.plan.precision.resolve_precision`), a model that
            cannot load, nothing fits.
    """
    if not loss_cfg.uses_gradient_cache:
        raise UserError(
            f"loss.name: probe-minibatch measures the cached loss; with {loss_cfg.name!r} mini_batch_size is unused"
        )
    if max_size < 1:
        raise UserError(f"--max: must be at least 1, got {max_size}")
    dev = resolve_device(device)
    resolved = resolve_precision(precision or model_cfg.precision, dev)  # auto -> what training would use
    if resolved.tf32:
        enable_tf32()
    spec = TrialSpec(
        model=model_cfg.model_dump(),
        loss=loss_cfg.model_dump(),
        n_columns=n_columns,
        batch_size=batch_size,
        device=dev,
        world_size=max(1, world_size),
        sort_by_length=sort_by_length,
        precision=resolved.precision,
    )
    cap = min(max_size, batch_size)
    notes = []
    if dev == "cuda":
        import torch

        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        capacity = min(total, max_memory) if max_memory else total
        trial = CudaTrial(spec)
    else:
        capacity = max_memory or cpu_capacity()
        if not max_memory:
            notes.append(f"no --max-memory: budget is this machine's physical memory ({format_bytes(capacity)})")
        trial = SubprocessTrial(spec, kill_above_bytes=capacity)
    try:
        result = search_mini_batch(trial, capacity, margin, cap, knee_fraction=knee_fraction, on_trial=on_trial)
        if token_budget:
            probe_token_budget(result, trial, on_trial)
    finally:
        if isinstance(trial, CudaTrial):
            trial.close()  # never raises
    if getattr(trial, "poisoned", False):
        result.cuda_context_lost = True
        notes.append("a CUDA error left this process's GPU context unusable; later trials ran in child processes")
    result.world_size = spec.world_size
    result.ranks = per_rank_peaks(result)
    agreed = agree_across_ranks(result.recommended)
    if agreed != result.recommended:
        notes.append(f"this rank fits {result.recommended}; all ranks use the minimum, {agreed}")
        result.recommended = agreed
        if result.recommended_num_tokens is not None:
            result.recommended_num_tokens = agreed * result.tokens_per_row
    result.device = dev
    result.measured = {**(getattr(trial, "setup", None) or {}), "strategy": strategy, "ranks": ranks}
    result.notes = result.notes + notes + describe_setup(result.measured)  # what the trials measured
    return result


def summary_record(result: ProbeResult) -> dict:
    """The ``mini_batch_probe`` entry of ``run_summary.json``."""
    d = result.to_dict()
    d["override"] = override_line(result)
    return d


def override_line(result: ProbeResult) -> str:
    """The config override that applies the probe's answer (both fields when a budget was found)."""
    line = f"batch.mini_batch_size={result.recommended}"
    if result.recommended_num_tokens is not None:
        line += f" batch.mini_batch_num_tokens={result.recommended_num_tokens}"
    return line


def resolve_auto(
    plan,
    model_cfg,
    loss_cfg,
    n_columns: int,
    max_memory: str | None = None,
    margin: float = DEFAULT_MARGIN,
    sort_by_length: bool = True,
    strategy: str = "ddp",
):
    """Fill ``plan.mini_batch_size`` and ``plan.mini_batch_num_tokens`` when the config says
    ``batch.mini_batch_size: auto``.

    Probes on ``plan.device`` for ``plan.per_device_train_batch_size`` rows of ``n_columns`` texts
    (anchor, positive and the hard-negative columns), with the loss stage over the candidates of
    ``plan.world_size`` ranks when the plan gathers them (``strategy``: ``distributed.strategy``), and returns ``(plan with the recommended
    size, token budget and run-summary record, ProbeResult)`` (:meth:`~cembed.plan.resolve.Plan.with_probe`,
    the one amendment of a plan). A token budget the config sets
    (``plan.mini_batch_num_tokens``) is kept and not probed. A plan whose size is already set comes
    back unchanged with ``None``; so does a loss without mini-batches (its size becomes the batch
    size, with a warning).

    Raises:
        UserError: see :func:`run_probe`; also an unparsable ``max_memory``, or a CUDA error during
            the probe that left this process unable to train on the GPU (the message gives the size).
    """
    if plan.mini_batch_size is not None:
        return plan, None
    if not loss_cfg.uses_gradient_cache:
        return plan.with_probe(
            plan.per_device_train_batch_size,
            plan.mini_batch_num_tokens,
            warning=f"batch.mini_batch_size: auto has no effect with loss {loss_cfg.name}",
        ), None
    budget = parse_bytes(max_memory) if max_memory else None
    result = run_probe(
        model_cfg,
        loss_cfg,
        plan.per_device_train_batch_size,
        n_columns,
        plan.device,
        margin=margin,
        max_memory=budget,
        world_size=plan.world_size if plan.gather_across_devices else 1,
        sort_by_length=sort_by_length,  # default True: the sorted copies counted (the larger case)
        token_budget=plan.mini_batch_num_tokens is None,
        strategy=strategy,
        ranks=plan.world_size,
        precision=plan.precision,  # auto resolved by the plan
    )
    if result.cuda_context_lost:
        raise UserError(
            "batch.mini_batch_size: auto: a CUDA error during the probe left this process unable to use the GPU; "
            f"the probe's answer is {result.recommended}: pass {override_line(result)} and run again"
        )
    tokens = plan.mini_batch_num_tokens or result.recommended_num_tokens
    return plan.with_probe(result.recommended, tokens, summary_record(result)), result
