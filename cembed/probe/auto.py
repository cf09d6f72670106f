"""Running a probe: :func:`run_probe` (``cembed probe-minibatch``) picks the trial runner for the
device and the memory budget, runs the search (:func:`cembed.probe.search.search_mini_batch`) and
the token budget's trial, and agrees on the answer across ranks; :func:`resolve_auto` fills
``batch.mini_batch_size: auto`` (and the token budget) in a :class:`~cembed.plan.resolve.Plan`
before training. Both ask the loss config whether it uses gradient caching.
"""

from __future__ import annotations

import os
from typing import Callable

from cembed.distributed.collectives import agree_across_ranks, per_rank_peaks
from cembed.errors import UserError
from cembed.files import format_bytes, parse_bytes
from cembed.plan.precision import enable_tf32, resolve_device, resolve_precision
from cembed.probe.search import (
    DEFAULT_CAP,
    DEFAULT_MARGIN,
    KNEE_FRACTION,
    ProbeResult,
    TrialRecord,
    probe_token_budget,
    search_mini_batch,
)
from cembed.probe.setup import describe_setup
from cembed.probe.trials import CudaTrial, SubprocessTrial, TrialSpec


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
