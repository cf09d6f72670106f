"""``cembed estimate``'s arithmetic: steps, tokens, FLOPs, wall time, GPU-hours and disk of a run.

Everything here is pure arithmetic on numbers the caller gathered (the data's token lengths, the
plan's steps, the model's shape, a device rate); nothing is loaded or run. The FLOPs follow
:mod:`cembed.train.flops` (``passes x (2 N sum(l) + 4 L d sum(l^2))`` over real tokens), the
per-device rate is either a datasheet peak x an MFU (given or measured) or a FLOP/s measured on this
machine, and::

    step time  = FLOPs per step / (rate per device x devices)
    epoch time = step time x steps per epoch;  run time = step time x steps of the run
    GPU-hours  = run time x devices / 3600

A step's tokens are its rows x the mean real tokens per row over the data (the sampler draws every
row once per epoch, so the mean over the data is the mean over an epoch's steps). Each number in
:func:`estimate_run`'s answer is ``{"value": ..., "unit": ..., "source": ...}``, the source
``measured``, ``datasheet``, ``assumed`` or ``computed from`` the ones it is built of.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from cembed.errors import UserError
from cembed.train.flops import PEAKS, FlopModel, device_peak

BYTES_PER_DTYPE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def known_gpus() -> list[str]:
    """The part names of the datasheet peak table (:data:`cembed.train.flops.PEAKS`), e.g. ``"H100 SXM"``."""
    return [part.split(" (")[0] for _, part, *_ in PEAKS]


def gpu_peak(name: str, precision: str) -> tuple[float, str]:
    """The dense datasheet peak (FLOP/s) of the GPU ``name`` for a run at ``precision``.

    Args:
        name: a part as the user types it: ``H100-SXM``, ``h100 sxm``, ``A100`` (``-``/``_`` read as spaces).
        precision: the model's precision on that GPU: ``auto`` (bf16, fp16 on parts without bf16),
            ``bf16``, ``fp16``, or ``fp32`` (TF32 matmuls, cembed's default on CUDA).

    Returns:
        ``(peak FLOP/s, source line)``.

    Raises:
        UserError: an unknown part (the message lists the known ones) or one with no peak at ``precision``.
    """
    spoken = re.sub(r"[-_]+", " ", name).strip()
    if not any(re.search(pattern, spoken, flags=re.IGNORECASE) for pattern, *_ in PEAKS):
        raise UserError(f"--gpu: unknown GPU {name!r}; known: {', '.join(known_gpus())} (or set train.peak_tflops)")
    wanted = {"fp32": "tf32"}.get(precision, precision)
    if wanted == "auto":
        wanted = "bf16" if device_peak(spoken, "bf16")[0] is not None else "fp16"
    peak, source = device_peak(spoken, wanted)
    if peak is None:
        raise UserError(f"--gpu: {source}; pick another model.precision")
    return peak, source


def number(value, unit: str, source: str) -> dict:
    """One reported quantity: its value, unit and where it comes from."""
    return {"value": value, "unit": unit, "source": source}


@dataclass(frozen=True)
class TokenStats:
    """Real (non-padding) token lengths of the rows a step draws, per row over every text column.

    Attributes:
        rows: rows measured.
        mean_tokens: mean over rows of ``sum(l)`` over the row's columns, tokens.
        mean_tokens_sq: mean over rows of ``sum(l^2)`` over the row's columns, tokens^2.
        histogram: per column ``{bucket upper bound (tokens): rows}`` (powers of two).
        padded_share: share of the encoder's positions that are padding on the configured path
            (see :func:`token_stats`), 0..1.
        mean_by_column: per column, the mean real tokens of the rows that have it.
    """

    rows: int
    mean_tokens: float
    mean_tokens_sq: float
    histogram: dict[str, dict[int, int]]
    padded_share: float
    mean_by_column: dict[str, float] = field(default_factory=dict)


def token_stats(
    lengths: dict[str, list[int | None]],
    mini_batch: int,
    seed: int = 0,
    batch: int | None = None,
    sort_by_length: bool = False,
    packed: bool = False,
    pad_width: Callable[[int], int] | None = None,
) -> TokenStats:
    """:class:`TokenStats` of ``lengths`` (``{column: [tokens of each row, None where absent]}``,
    every list one entry per row).

    The padded share follows the configured path: rows in random order cut into per-device batches
    of ``batch`` rows (default ``mini_batch``), each column sorted by length within its batch when
    ``sort_by_length`` (the cached loss's ``batch.sort_by_length``), cut into ``mini_batch`` rows
    (the whole per-device batch for a plain loss) padded to their longest; ``packed`` (unpadded
    mini-batches, ``batch.unpad``) has no padding. ``pad_width``: the width a forward whose longest
    row has ``n`` tokens runs at, for a plain loss the collator's
    (:meth:`cembed.data.tokens.collator.PaddingCollator.width`: ``batch.pad_to_multiple_of``); None:
    the longest row, as a cached loss runs (sentence-transformers' ``_create_minibatch`` trims each
    mini-batch to its longest row, undoing the collator's rounding)."""
    columns = list(lengths)
    rows = len(lengths[columns[0]]) if columns else 0
    total = total_sq = 0
    histogram: dict[str, dict[int, int]] = {}
    real = positions = 0
    rng = random.Random(seed)
    means: dict[str, float] = {}
    for column in columns:
        present = [n for n in lengths[column] if n is not None]
        if present:
            means[column] = sum(present) / len(present)
        total += sum(present)
        total_sq += sum(n * n for n in present)
        buckets: dict[int, int] = {}
        for n in present:
            bound = 1 << max(0, (n - 1).bit_length())
            buckets[bound] = buckets.get(bound, 0) + 1
        histogram[column] = dict(sorted(buckets.items()))
        shuffled = present[:]
        rng.shuffle(shuffled)
        size, per_device = max(1, mini_batch), max(1, batch or mini_batch)
        for start in range(0, len(shuffled), per_device):
            rows_of_batch = shuffled[start : start + per_device]
            if sort_by_length:
                rows_of_batch.sort()
            for i in range(0, len(rows_of_batch), size):
                chunk = rows_of_batch[i : i + size]
                real += sum(chunk)
                width = pad_width(max(chunk)) if pad_width else max(chunk)
                positions += sum(chunk) if packed else width * len(chunk)
    return TokenStats(
        rows=rows,
        mean_tokens=total / rows if rows else 0.0,
        mean_tokens_sq=total_sq / rows if rows else 0.0,
        histogram=histogram,
        padded_share=1 - real / positions if positions else 0.0,
        mean_by_column=means,
    )


@dataclass(frozen=True)
class Rate:
    """Model FLOP/s one device sustains, and where the figure comes from.

    Attributes:
        flops_per_s: per device.
        source: e.g. ``"datasheet H100 SXM bf16 peak x MFU 0.4 (assumed)"``, ``"measured: 3 steps on this machine"``.
        peak_flops, peak_source, mfu, mfu_source: the parts of a peak x MFU rate (None for a measured rate).
    """

    flops_per_s: float
    source: str
    peak_flops: float | None = None
    peak_source: str | None = None
    mfu: float | None = None
    mfu_source: str | None = None


def peak_rate(peak_flops: float, peak_source: str, mfu: float, mfu_source: str) -> Rate:
    """A device rate of ``peak_flops x mfu``.

    Raises:
        UserError: ``mfu`` outside (0, 1].
    """
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu: {mfu:g} is not a share of the peak; give a value in (0, 1], e.g. --mfu 0.35")
    return Rate(
        peak_flops * mfu, f"{peak_source} x MFU {mfu:g} ({mfu_source})", peak_flops, peak_source, mfu, mfu_source
    )


def estimate_run(
    stats: TokenStats,
    samples_per_step: int,
    steps_per_epoch: int,
    total_steps: int,
    flop_constants: tuple[int, int, int, int],
    rate: Rate,
    devices: int,
    scoring: tuple[float, str] | None = None,
) -> dict:
    """Steps, tokens, FLOPs and wall time of a run.

    Args:
        stats: the data's token lengths (:func:`token_stats`).
        samples_per_step: rows per optimizer step over all devices (batch x devices x accumulation).
        steps_per_epoch, total_steps: optimizer steps of one epoch and of the run.
        flop_constants: ``(N, L, d, passes)`` of :class:`cembed.train.flops.FlopModel`.
        rate: FLOP/s of one device.
        devices: devices of the run (world size).
        scoring: ``(FLOPs per step, source)`` of the loss's scoring beyond the encoder (a multi-vector
            model's MaxSim: :meth:`cembed.model.kinds.registry.ModelKind.scoring_flops`), added to the
            step's FLOPs; None: none counted (a dense loss's score matrix is negligible next to the encoder).

    Returns:
        ``{steps_per_epoch, steps, tokens_per_step, tokens, flops_per_step, flops, seconds_per_step,
        epoch_seconds, run_seconds, gpu_hours}`` (and ``scoring_flops_per_step`` with ``scoring``),
        each a :func:`number`.
    """
    n, layers, width, passes = flop_constants
    tokens_step = samples_per_step * stats.mean_tokens
    sq_step = samples_per_step * stats.mean_tokens_sq
    flops_step = FlopModel(n, layers, width, passes).flops(tokens_step, sq_step)  # the meter's own count
    encoder_source = f"{passes} x (2 N sum(l) + 4 L d sum(l^2)), N={n} L={layers} d={width}"
    extra = {}
    if scoring is not None:
        flops_step += scoring[0]
        encoder_source += " + scoring FLOPs per step"
        extra = {"scoring_flops_per_step": number(scoring[0], "FLOP", scoring[1])}
    seconds_step = flops_step / (rate.flops_per_s * devices)
    data = f"mean real tokens per row over {stats.rows} rows of the pre-tokenized data"
    return {
        **extra,
        "steps_per_epoch": number(steps_per_epoch, "steps", "config and rows the sampler places"),
        "steps": number(total_steps, "steps", "train.max_steps or epochs x steps per epoch"),
        "tokens_per_step": number(tokens_step, "tokens", f"{samples_per_step} rows x {data}"),
        "tokens": number(tokens_step * total_steps, "tokens", "tokens per step x steps"),
        "flops_per_step": number(flops_step, "FLOP", encoder_source),
        "flops": number(flops_step * total_steps, "FLOP", "FLOPs per step x steps"),
        "seconds_per_step": number(seconds_step, "s", f"FLOPs per step / ({rate.source} x {devices} devices)"),
        "epoch_seconds": number(seconds_step * steps_per_epoch, "s", "seconds per step x steps per epoch"),
        "run_seconds": number(seconds_step * total_steps, "s", "seconds per step x steps"),
        "gpu_hours": number(seconds_step * total_steps * devices / 3600, "h", "run seconds x devices / 3600"),
    }


def checkpoint_bytes(parameters: int, dtype: str) -> dict:
    """Disk taken by the saved weights: ``parameters x bytes of dtype`` (safetensors adds a small
    header; optimizer state in a resumable checkpoint is not counted)."""
    size = BYTES_PER_DTYPE.get(dtype, 4)
    return number(parameters * size, "bytes", f"{parameters} parameters x {size} bytes ({dtype}, the saved dtype)")


def data_wait_risk(production_s: float | None, seconds_per_step: float, where: str = "this machine") -> dict:
    """Whether producing a batch (``production_s`` per step, measured) can keep up with the predicted
    step: the ratio, and ``low`` (< 10 %), ``some`` (< 50 %) or ``high``; ``"not measured"`` without
    a measurement."""
    if production_s is None:
        return number("not measured", "", "run with --calibrate STEPS to measure batch production")
    ratio = production_s / seconds_per_step if seconds_per_step > 0 else float("inf")
    level = "low" if ratio < 0.1 else "some" if ratio < 0.5 else "high"
    return {
        "value": level,
        "batch_production_s": production_s,
        "share_of_step": ratio,
        "unit": "",
        "source": f"measured batch production per step on {where} / predicted seconds per step",
    }


def probe_memory(probe: dict | None, mini_batch: int | None) -> dict:
    """Peak memory of one rank at ``mini_batch`` from a probe record (``run_summary.json``'s
    ``mini_batch_probe``: its trials' ``size`` and ``peak_bytes``): the smallest tried size at or
    above ``mini_batch`` (the worst case bounds the smaller ones), else ``"run probe-minibatch"``."""
    trials = [t for t in (probe or {}).get("trials", []) if t.get("peak_bytes") and mini_batch is not None]
    above = sorted((t for t in trials if t["size"] >= mini_batch), key=lambda t: t["size"])
    if not above:
        return number("run probe-minibatch", "", "no probe trial at this mini-batch size")
    trial = above[0]
    return number(trial["peak_bytes"], "bytes", f"measured: probe's worst case at mini_batch_size {trial['size']}")
