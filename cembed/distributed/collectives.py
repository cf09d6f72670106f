"""The collectives that keep the ranks of a job in step: agreeing on a number (:func:`max_over_ranks`,
:func:`agree_across_ranks`, both :func:`reduce_over_ranks`), gathering every rank's values
(:func:`gather_over_ranks`, :func:`per_rank_peaks`) and refusing a job whose ranks differ
(:func:`require_same_on_all_ranks`).

Each is a no-op (it returns this process's own value) without an initialized multi-process group,
and every rank must call it at the same point. torch is imported lazily.
"""

from __future__ import annotations

from typing import Literal

from cembed.errors import UserError


def _group_device():
    """The device a collective's tensor lives on: the current CUDA device for NCCL, else the CPU;
    None without an initialized multi-process group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def reduce_over_ranks(value: int, op: Literal["max", "min"]) -> int:
    """``value`` reduced over all ranks by ``op`` (a one-element int64 all-reduce); ``value`` itself
    without an initialized multi-process group. Every rank must call it at the same point.

    Raises:
        ValueError: ``op`` is not ``max`` or ``min``.
    """
    import torch
    import torch.distributed as dist

    if op not in ("max", "min"):
        raise ValueError(f"reduce_over_ranks: op must be 'max' or 'min', got {op!r}")
    device = _group_device()
    if device is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return int(t.item())


def max_over_ranks(value: int) -> int:
    """The largest ``value`` over all ranks (:func:`reduce_over_ranks` with ``max``).

    Used for decisions that all ranks must take together, e.g. stopping on a signal that reached
    only some of them: a rank that stops alone leaves the others waiting in the next all-reduce.
    """
    return reduce_over_ranks(value, "max")


def agree_across_ranks(size: int) -> int:
    """The probe across ranks: every rank probes its own GPU and all ranks use the smallest answer
    (:func:`reduce_over_ranks` with ``min``). Used by :func:`cembed.probe.auto.run_probe`."""
    return reduce_over_ranks(size, "min")


def gather_over_ranks(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (one all-gather of float64), in rank order; ``[values]`` without an
    initialized multi-process group. Every rank must call it at the same point with as many values."""
    import torch
    import torch.distributed as dist

    device = _group_device()
    if device is None:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [r.tolist() for r in rows]


def require_same_on_all_ranks(facts: dict[str, object]) -> None:
    """Refuse, on every rank at once, a job whose ranks differ in any of ``facts``.

    For everything that decides how many collectives a step issues (mini-batch size, token budget,
    columns, rows per rank, accumulation, rows in the data): ranks that differ would pair up
    mismatched collectives, which hangs until the process-group timeout or silently sums partial
    gradients. One all-reduce of a fingerprint per fact finds a difference; only then are the values
    gathered to name them. Every rank must call it at the same point; a no-op without an initialized
    multi-process group.

    Args:
        facts: name -> a JSON-serializable value (compared by its JSON text).

    Raises:
        UserError: on every rank, naming each differing fact with each rank's value.
    """
    import json
    import zlib

    import torch
    import torch.distributed as dist

    device = _group_device()
    if device is None:
        return
    names = list(facts)
    codes = [zlib.crc32(json.dumps(facts[n], sort_keys=True, default=str).encode()) for n in names]
    t = torch.tensor(codes + [-c for c in codes], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    highest, lowest = t[: len(names)].tolist(), [-v for v in t[len(names) :].tolist()]
    differ = [n for n, hi, lo in zip(names, highest, lowest) if hi != lo]
    if not differ:
        return
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, {n: facts[n] for n in differ})
    detail = "; ".join(f"{n}: " + ", ".join(f"rank {r} {v[n]!r}" for r, v in enumerate(values)) for n in differ)
    raise UserError(
        f"the ranks of this job disagree on what each training step does ({detail}); every rank must "
        "run the same config on the same data (same files, same overrides), or their collectives would "
        "not pair up"
    )


def per_rank_peaks(result) -> list[dict]:
    """Each rank's own answer and its measured peak at that size, from a ``cembed.probe.search.ProbeResult``
    (``all_gather_object`` when a torch.distributed process group is initialized, else this
    process's entry alone). Every rank must call it at the same point."""
    import torch.distributed as dist

    peak = next((r.peak_bytes for r in result.trials if r.size == result.recommended and r.fits), None)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    mine = {"rank": rank, "recommended": result.recommended, "peak_bytes": peak, "limit_bytes": result.limit_bytes}
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
