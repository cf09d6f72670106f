"""The probe across ranks: in a torch.distributed process group every rank probes its own GPU and
all ranks use the smallest answer (:func:`agree_across_ranks`); each rank's own answer and peak are
gathered for the report (:func:`per_rank_peaks`). Used by :func:`cembed.probe.search.run_probe`."""

from __future__ import annotations


def agree_across_ranks(size: int) -> int:
    """All ranks use the minimum: ``all_reduce(MIN)`` of ``size`` when a torch.distributed process
    group is initialized, else ``size`` unchanged."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return size
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([size], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


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
