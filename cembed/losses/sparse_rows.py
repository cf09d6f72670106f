"""Sparse-model embeddings held by their active coordinates: :class:`SparseRows`, the form a cached
sparse loss (:mod:`cembed.losses.cached_splade`) keeps its rows and their gradients in.

A SPLADE weight is ``w_j = pool_t log(1 + relu(logit_tj))`` (``max`` or ``sum`` over the row's
positions; ``log1p_relu`` applies ``log1p`` once more; Formal et al. 2021, arXiv:2109.10086). Where
``w_j = 0`` every ``logit_tj <= 0`` (padding positions are masked to 0), so the ReLU passes no gradient
back to the model at that coordinate, whatever the loss's gradient there: the model's gradient needs the
loss's gradient at a row's non-zero coordinates only. Holding each row as (column index, value) pairs of
its non-zero coordinates -- compressed sparse rows (CSR) -- is therefore exact, and at the 100-300 active
coordinates of a trained SPLADE row it takes about 1-2 KB instead of the 122 KB (fp32) of a dense
30,522-wide row. ``tests/losses/test_cached_splade.py`` checks the model's gradients against the dense form.

Where rows are too dense for this to pay (a fresh masked-language model activates most of its
vocabulary), :meth:`SparseRows.from_dense` keeps them dense: the form is chosen per mini-batch by bytes
(:func:`sparse_pays`). A column's mini-batches are put together by :func:`assemble` in one form.

Scores against a dense chunk of rows (:meth:`SparseRows.scores`) use torch's CSR kernels in (at least) float32:
``csr @ chunk.T`` forward, ``grad @ csr`` and a sampled product (``torch.sparse.sampled_addmm``, the
gradient of the stored values only) backward; dense rows use a plain matmul in their own precision,
as sentence-transformers does.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch marks its CSR support "beta" with a UserWarning at each CSR tensor it builds.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")

INT32_MAX = 2**31 - 1
DENSE_BLOCK_ROWS = 4096  # rows of a dense column summed at a time (column_sums)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision scores and sums are computed in: at least float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def index_dtype(nnz: int, width: int) -> torch.dtype:
    """int32 indices where they fit (half the bytes of int64), else int64."""
    return torch.int32 if max(nnz, width) <= INT32_MAX else torch.int64


def sparse_bytes(rows: int, nnz: int, value_bytes: int, width: int) -> int:
    """Bytes of ``rows`` rows with ``nnz`` active coordinates in CSR: values, column indices, row offsets."""
    index_bytes = torch.tensor([], dtype=index_dtype(nnz, width)).element_size()
    return nnz * (value_bytes + index_bytes) + (rows + 1) * index_bytes


def sparse_pays(rows: int, nnz: int, width: int, value_bytes: int) -> bool:
    """Whether CSR holds ``rows`` x ``width`` rows with ``nnz`` active coordinates in fewer bytes than the
    dense form (``rows * width * value_bytes``): below about 50 % density in float32, 33 % in bfloat16.
    The gradient has the values' shape in either form, so the comparison holds for the whole cache."""
    return sparse_bytes(rows, nnz, value_bytes, width) < rows * width * value_bytes


class _CsrScores(torch.autograd.Function):
    """``chunk @ rows.T`` for CSR ``rows`` (crow, col, values) and a dense ``chunk``, in at least float32
    (:func:`compute_dtype`), with the gradients of ``chunk`` (dense) and of the stored ``values`` only
    (the sampled product)."""

    @staticmethod
    def forward(ctx, chunk, values, crow, col, width):
        ctx.save_for_backward(chunk, values, crow, col)
        ctx.width = width
        dtype = compute_dtype(values.dtype)
        with torch.autocast(chunk.device.type, enabled=False):
            matrix = torch.sparse_csr_tensor(
                crow, col, values.to(dtype), (crow.numel() - 1, width), check_invariants=False
            )
            return (matrix @ chunk.to(dtype).t()).t()

    @staticmethod
    def backward(ctx, grad):
        chunk, values, crow, col = ctx.saved_tensors
        grad_chunk = grad_values = None
        dtype = compute_dtype(values.dtype)
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.to(dtype)
            matrix = torch.sparse_csr_tensor(
                crow, col, values.detach().to(dtype), (crow.numel() - 1, ctx.width), check_invariants=False
            )
            if ctx.needs_input_grad[0]:
                grad_chunk = (grad @ matrix).to(chunk.dtype)
            if ctx.needs_input_grad[1]:
                sampled = torch.sparse.sampled_addmm(matrix, grad.t().contiguous(), chunk.detach().to(dtype), beta=0.0)
                grad_values = sampled.values().to(values.dtype)
        return grad_chunk, grad_values, None, None, None


@dataclass
class SparseRows:
    """``rows`` non-negative vectors of ``width`` coordinates (a sparse model's vocabulary), in one of two forms.

    Attributes:
        values: sparse form: ``(nnz,)`` the active coordinates' weights, row by row, columns ascending;
            dense form: ``(rows, width)``. The run's precision.
        width: the vectors' length.
        crow: sparse form: ``(rows + 1,)`` row offsets into ``values`` (CSR); None when dense.
        col: sparse form: ``(nnz,)`` column index of each value; None when dense.

    A gradient of such rows is a ``SparseRows`` of the same form and pattern, ``values`` holding the
    gradient (the sparse form: at the active coordinates only).
    """

    values: torch.Tensor
    width: int
    crow: torch.Tensor | None = None
    col: torch.Tensor | None = None

    @classmethod
    def from_dense(cls, x: torch.Tensor, form: str = "auto") -> SparseRows:
        """The rows of ``x`` (``(rows, width)``, detached) in the form ``form``: ``sparse``, ``dense``, or
        ``auto`` (sparse where :func:`sparse_pays`). Exactly the non-zero coordinates are kept.
        ``auto`` reads the count of non-zeros on the host (one synchronisation)."""
        x = x.detach()
        rows, width = x.shape
        if form == "auto":
            form = "sparse" if sparse_pays(rows, int((x != 0).sum()), width, x.element_size()) else "dense"
        if form == "dense":
            return cls(x, width)
        if form != "sparse":
            raise ValueError(f"form must be 'auto', 'sparse' or 'dense', got {form!r}")
        csr = x.to_sparse_csr()
        dtype = index_dtype(csr.values().numel(), width)
        return cls(csr.values(), width, csr.crow_indices().to(dtype), csr.col_indices().to(dtype))

    @property
    def is_sparse(self) -> bool:
        return self.crow is not None

    @property
    def rows(self) -> int:
        return self.crow.numel() - 1 if self.is_sparse else self.values.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held: values, and for the sparse form its indices."""
        held = [self.values] + ([self.crow, self.col] if self.is_sparse else [])
        return sum(t.numel() * t.element_size() for t in held)

    def row_active(self) -> torch.Tensor:
        """``(rows,)`` int64: each row's count of non-zero coordinates (its L0 norm)."""
        if self.is_sparse:
            return self.crow.diff().to(torch.int64)
        return (self.values != 0).sum(dim=1)

    def active(self) -> int:
        """Non-zero coordinates over all rows (a host read when dense)."""
        return self.values.numel() if self.is_sparse else int((self.values != 0).sum())

    def with_values(self, values: torch.Tensor) -> SparseRows:
        """The same rows' pattern holding ``values`` (e.g. a gradient, or a detached leaf)."""
        return SparseRows(values, self.width, self.crow, self.col)

    def row_ids(self) -> torch.Tensor:
        """Sparse form: ``(nnz,)`` int64, the row of each stored value."""
        rows = torch.arange(self.rows, device=self.values.device)
        return torch.repeat_interleave(rows, self.row_active(), output_size=self.values.numel())

    def slice(self, begin: int, end: int) -> SparseRows:
        """Rows ``begin:end`` (views of this one's tensors; the sparse form reads two row offsets on the host)."""
        if not self.is_sparse:
            return SparseRows(self.values[begin:end], self.width)
        lo, hi = (int(v) for v in self.crow[[begin, end]].tolist())
        return SparseRows(self.values[lo:hi], self.width, self.crow[begin : end + 1] - lo, self.col[lo:hi])

    def take(self, index: torch.Tensor) -> SparseRows:
        """Rows ``index`` (``(n,)`` int64), in that order, as a new ``SparseRows`` of the same form (a copy;
        the sparse form gathers each row's stored coordinates: ``O(nnz)``, one host read of the new size)."""
        index = index.to(self.values.device)
        if not self.is_sparse:
            return SparseRows(self.values.index_select(0, index), self.width)
        lengths = self.row_active().index_select(0, index)
        crow = torch.zeros(index.numel() + 1, dtype=torch.int64, device=index.device)
        torch.cumsum(lengths, 0, out=crow[1:])
        nnz = int(crow[-1])
        starts = self.crow.to(torch.int64).index_select(0, index)
        # Position p of the new rows reads the old position starts[row(p)] + (p - crow[row(p)]).
        row = torch.repeat_interleave(torch.arange(index.numel(), device=index.device), lengths, output_size=nnz)
        source = starts[row] + torch.arange(nnz, device=index.device) - crow[row]
        dtype = self.crow.dtype
        return SparseRows(self.values[source], self.width, crow.to(dtype), self.col[source])

    def to_dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``(rows, width)``, differentiable in ``values``; ``dtype``: the values' dtype by default."""
        dtype = dtype or self.values.dtype
        if not self.is_sparse:
            return self.values.to(dtype)
        out = torch.zeros(self.rows, self.width, dtype=dtype, device=self.values.device)
        return out.index_put((self.row_ids(), self.col.to(torch.int64)), self.values.to(dtype))

    def as_form(self, sparse: bool) -> SparseRows:
        """These rows in the sparse or the dense form (itself if already so)."""
        if sparse == self.is_sparse:
            return self
        if sparse:
            return SparseRows.from_dense(self.values, "sparse")
        return SparseRows(self.to_dense(), self.width)

    def scores(self, chunk: torch.Tensor) -> torch.Tensor:
        """``chunk @ rows.T``: ``(c, rows)`` dot products of the dense ``(c, width)`` ``chunk`` with each row,
        differentiable in ``chunk`` and ``values``, in :func:`compute_dtype` in either form (sparse: CSR
        kernels; dense: a matmul, ``DENSE_BLOCK_ROWS`` rows at a time, outside autocast): a dense row's dot
        products exceed float16's range (a fresh MLM: 30,522 coordinates of about 2 each)."""
        if self.is_sparse:
            return _CsrScores.apply(chunk, self.values, self.crow, self.col, self.width)
        dtype = compute_dtype(self.values.dtype)
        with torch.autocast(chunk.device.type, enabled=False):
            if dtype == self.values.dtype:
                return chunk.to(dtype) @ self.values.t()
            chunk = chunk.to(dtype)
            return torch.cat([chunk @ block.to(dtype).t() for block in self.values.split(DENSE_BLOCK_ROWS)], dim=1)

    def column_sums(self, row_weight: torch.Tensor | None = None) -> torch.Tensor:
        """``(width,)`` in :func:`compute_dtype`: ``sum_i row_weight_i * w_ij`` (each row's weight 1 without
        ``row_weight``), differentiable in ``values``."""
        dtype = compute_dtype(self.values.dtype)
        if not self.is_sparse:  # blocks of rows: a bfloat16 column is never copied whole into float32
            out = torch.zeros(self.width, dtype=dtype, device=self.values.device)
            for begin in range(0, self.rows, DENSE_BLOCK_ROWS):
                block = self.values[begin : begin + DENSE_BLOCK_ROWS].to(dtype)
                weight = None if row_weight is None else row_weight[begin : begin + DENSE_BLOCK_ROWS].to(dtype)
                out = out + (block.sum(dim=0) if weight is None else weight @ block)
            return out
        values = self.values.to(dtype)
        if row_weight is not None:
            values = values * row_weight.to(values.dtype)[self.row_ids()]
        out = torch.zeros(self.width, dtype=values.dtype, device=values.device)
        return out.index_add(0, self.col.to(torch.int64), values)


def assemble(parts: list[SparseRows], form: str = "auto") -> SparseRows:
    """One column from its mini-batches' rows, in order, in one form: the parts' form if they agree,
    else (or with ``form="auto"`` and mixed parts) the one :func:`sparse_pays` picks for the whole.
    ``form`` ``sparse`` / ``dense`` forces it. ``parts`` is emptied as it is copied (each part freed
    after its copy), so the column and its parts are not held whole at once.

    Raises:
        ValueError: no parts, or parts of different widths.
    """
    if not parts:
        raise ValueError("assemble needs at least one part")
    width = parts[0].width
    if any(p.width != width for p in parts):
        raise ValueError(f"parts of different widths: {sorted({p.width for p in parts})}")
    rows = sum(p.rows for p in parts)
    nnz = sum(p.active() for p in parts)
    value_bytes = parts[0].values.element_size()
    if form == "auto":
        kinds = {p.is_sparse for p in parts}
        sparse = kinds.pop() if len(kinds) == 1 else sparse_pays(rows, nnz, width, value_bytes)
    else:
        sparse = form == "sparse"
    if len(parts) == 1:
        return parts.pop().as_form(sparse)
    first = parts[0].values
    if not sparse:
        out = torch.empty(rows, width, dtype=first.dtype, device=first.device)
        at = 0
        while parts:
            part = parts.pop(0).as_form(False)
            out[at : at + part.rows] = part.values
            at += part.rows
        return SparseRows(out, width)
    dtype = index_dtype(nnz, width)
    values = torch.empty(nnz, dtype=first.dtype, device=first.device)
    col = torch.empty(nnz, dtype=dtype, device=first.device)
    crow = torch.zeros(rows + 1, dtype=dtype, device=first.device)
    row_at = value_at = 0
    while parts:
        part = parts.pop(0).as_form(True)
        n = part.values.numel()
        values[value_at : value_at + n] = part.values
        col[value_at : value_at + n] = part.col
        crow[row_at + 1 : row_at + part.rows + 1] = part.crow[1:] + value_at
        row_at, value_at = row_at + part.rows, value_at + n
    return SparseRows(values, width, crow, col)


class SparseRowOps:
    """The row operations of a cached column held as :class:`SparseRows` (:class:`cembed.losses.reps.RowOps`)."""

    def cat(self, parts: list[SparseRows]) -> SparseRows:
        return assemble(list(parts))

    def take(self, column: SparseRows, index: torch.Tensor) -> SparseRows:
        return column.take(index)

    def split(self, column: SparseRows, sizes: list[int]) -> list[SparseRows]:
        out, at = [], 0
        for size in sizes:
            out.append(column.slice(at, at + size))
            at += size
        return out


SPARSE_ROWS = SparseRowOps()


def _all_gather_padded(tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every rank's ``tensor`` (first dimension ``sizes[rank]``, the rest alike), concatenated in rank order."""
    longest = max(sizes)
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded)
    return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)])


@dataclass
class GatheredRows:
    """A column gathered from every rank (:func:`gather_rows`): ``rows`` holds all ranks' rows in rank order;
    this rank's are rows ``row_start:row_start + local_rows``."""

    rows: SparseRows
    row_start: int
    local_rows: int

    def local_grad(self, grad: torch.Tensor) -> SparseRows:
        """This rank's part of the summed gradient: ``grad`` (the gathered rows' values' gradient on this
        rank) summed over ranks (one all-reduce), then cut to this rank's rows (a copy, so the gathered
        rows can be freed)."""
        dist.all_reduce(grad)
        summed = self.rows.with_values(grad)
        part = summed.slice(self.row_start, self.row_start + self.local_rows)
        return SparseRows(
            part.values.clone(),
            part.width,
            None if part.crow is None else part.crow.clone(),
            None if part.col is None else part.col.clone(),
        )


def gather_rows(local: SparseRows, form: str = "auto") -> GatheredRows:
    """All ranks' rows of one column (``torch.distributed`` initialised), in one form on every rank:
    ``form`` ``sparse`` / ``dense``, or ``auto``: sparse where :func:`sparse_pays` for all ranks' rows
    together (every rank decides alike from the gathered counts). Ranks may hold different row counts.
    Collectives: one gather of (rows, non-zeros) per rank, then two (dense) or four (sparse) gathers."""
    device = local.values.device
    counts = torch.tensor([local.rows, local.active()], dtype=torch.int64, device=device)
    every = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(every, counts)
    rows_per_rank, nnz_per_rank = zip(*(tuple(c.tolist()) for c in every))
    rank = dist.get_rank()
    row_start = sum(rows_per_rank[:rank])
    if form == "auto":
        sparse = sparse_pays(sum(rows_per_rank), sum(nnz_per_rank), local.width, local.values.element_size())
    else:
        sparse = form == "sparse"
    local = local.as_form(sparse)
    if not sparse:
        gathered = SparseRows(_all_gather_padded(local.values, list(rows_per_rank)), local.width)
        return GatheredRows(gathered, row_start, local.rows)
    dtype = index_dtype(sum(nnz_per_rank), local.width)
    values = _all_gather_padded(local.values, list(nnz_per_rank))
    col = _all_gather_padded(local.col.to(dtype), list(nnz_per_rank))
    active = _all_gather_padded(local.row_active(), list(rows_per_rank))
    crow = torch.zeros(active.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(active, 0, out=crow[1:])
    return GatheredRows(SparseRows(values, local.width, crow.to(dtype), col), row_start, local.rows)
