"""How a cached loss puts a column's rows together, reorders and cuts them: :class:`RowOps`. cembed's
length sorting (:class:`cembed.losses.length_sorted.LengthSortedMixin`) embeds each column in sorted
order and hands the loss its rows in the original order; it reorders through the loss's ``row_ops``, so
it never needs to know what a row is. A dense model's row is one tensor row (:data:`TENSOR_ROWS`, the
default); a sparse model's rows are :class:`cembed.losses.sparse_rows.SparseRows`
(:data:`cembed.losses.sparse_rows.SPARSE_ROWS`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class RowOps(Protocol):
    """The three operations on a column of cached rows (a tensor of ``(rows, ...)``, or another row
    container)."""

    def cat(self, parts: list[Any]) -> Any:
        """One column from its mini-batches' rows, in order."""

    def take(self, column: Any, index: torch.Tensor) -> Any:
        """Rows ``index`` (``(n,)`` int64) of ``column``, in that order (a copy)."""

    def split(self, column: Any, sizes: list[int]) -> list[Any]:
        """``column`` cut into consecutive parts of ``sizes`` rows."""


class TensorRows:
    """:class:`RowOps` of a column held as tensors of shape ``(rows, ...)``."""

    def cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts))

    def take(self, column: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return column.index_select(0, index.to(column.device))

    def split(self, column: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(column.split(sizes))


TENSOR_ROWS = TensorRows()


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i``: applied with ``take``, it undoes ``take(·, order)``."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse
