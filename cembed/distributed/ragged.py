"""Gathering rows of different sizes from every rank, with gradient: each rank's ``(n_r, ...)`` tensor
(``n_r`` may differ by rank: a rank's documents hold more or fewer tokens) becomes the ranks' tensors
end to end in rank order, on every rank. The backward sums every rank's gradient of the gathered tensor
and keeps this rank's rows, as ``torch.distributed.nn.all_gather``'s does for equal sizes (what
sentence-transformers' ``all_gather_with_grad`` uses): a rank's rows get the gradient every rank's loss
sends them. Without a process group it returns the tensor itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _sizes(rows: int, device) -> list[int]:
    """Every rank's row count (one all-gather of a scalar)."""
    local = torch.tensor([rows], device=device, dtype=torch.int64)
    every = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    return [int(n) for n in torch.cat(every).tolist()]


def _gather(tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """All ranks' rows, each rank's padded to the largest count for the collective, then cut back."""
    most = max(sizes)
    padded = torch.zeros((most, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    every = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(every, padded.contiguous())
    return torch.cat([part[:n] for part, n in zip(every, sizes)])


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
        ctx.sizes, ctx.rank = sizes, rank
        return _gather(tensor, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        begin = sum(ctx.sizes[: ctx.rank])
        return grad[begin : begin + ctx.sizes[ctx.rank]], None, None


def gather_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Every rank's rows of ``tensor`` end to end, in rank order, with gradient (see the module docstring).

    Returns:
        ``(gathered, sizes)``: the gathered tensor and each rank's row count. Without an initialised
        process group (or with one process): ``(tensor, [rows])``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor, [tensor.shape[0]]
    sizes = _sizes(tensor.shape[0], tensor.device)
    if tensor.requires_grad:
        return _GatherRows.apply(tensor, sizes, dist.get_rank()), sizes
    return _gather(tensor, sizes), sizes


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
