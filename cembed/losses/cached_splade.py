"""A cached SPLADE loss whose cache holds each row's active coordinates only:
:class:`SparseCachedSpladeLoss`, sentence-transformers' ``CachedSpladeLoss`` (GradCache, Gao et al.
2021, arXiv:2101.06983, around ``SpladeLoss``, Formal et al. 2022, arXiv:2205.04733) with three changes.

* **The cache.** sentence-transformers keeps a dense vocabulary-wide row per text and its gradient
  (122 KB each in float32 for a 30,522-token vocabulary). Here each mini-batch's rows are kept as
  :class:`cembed.losses.sparse_rows.SparseRows`: their non-zero coordinates (index + value in the run's
  precision), and the loss stage's gradient at those coordinates only. This is exact (the model's
  gradient is zero wherever a weight is zero; see :mod:`cembed.losses.sparse_rows`). A mini-batch too
  dense for the sparse form to pay (a fresh masked-language model) is kept dense, and the counters
  (:class:`cembed.losses.counts.SparseCounts`, ``sparse_counts``) say so.
* **The score matrix is chunked**, ``mini_batch_size`` anchors at a time, as the dense
  ``CachedMultipleNegativesRankingLoss`` does: the loss stage holds ``mini_batch_size x candidates``
  scores, never ``batch x candidates``.
* **The FLOPS regularizer is global.** ``FLOPS = sum_j (mean_i w_ij)^2`` (Paria et al. 2020,
  arXiv:2004.05665; with ``threshold``, rows with at most that many non-zero coordinates count as zero
  rows, arXiv:2504.14839) is taken over the rows of *every* rank: one vocabulary-wide sum per column
  group is all-reduced. One process with ``2B`` rows and two with ``B`` each therefore give the same
  loss and the same gradient (after DDP's average, so each rank's gradient is scaled by the world size),
  where sentence-transformers regularises each rank's own rows (another sparsity per GPU count).

The contrastive part is ``SparseMultipleNegativesRankingLoss`` (InfoNCE on dot products, with its
``scale``, ``directions``, ``partition_mode`` and ``gather_across_devices``); the regularizers are
``FlopsLoss`` (documents, and queries with ``query_regularizer_weight``; optional thresholds;
``use_document_regularizer_only``). Being a ``SpladeLoss``, the loss works with sentence-transformers'
``SpladeRegularizerWeightSchedulerCallback`` (the regularizer weights' warm-up from 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from sentence_transformers.base.losses.gradcache import _backward_hook, _minibatch_ranges
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sparse_encoder.losses import CachedSpladeLoss, FlopsLoss
from sentence_transformers.util import dot_score

from cembed.losses.counts import SparseCounts
from cembed.losses.sparse_rows import SPARSE_ROWS, GatheredRows, SparseRows, assemble, compute_dtype, gather_rows

CACHE_FORMS = ("auto", "sparse", "dense")


def world_size() -> int:
    """Processes in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class MiniBatchGrads(Sequence):
    """A column's cached gradient, one dense ``(rows, width)`` tensor per mini-batch, made when read:
    the shape sentence-transformers' GradCache backward replay expects (a sequence of the mini-batches'
    gradients), while only the sparse gradient is held."""

    def __init__(self, grad: SparseRows, ranges: list[tuple[int, int]]) -> None:
        self.grad = grad
        self.ranges = ranges

    def __len__(self) -> int:
        return len(self.ranges)

    def __getitem__(self, index: int) -> torch.Tensor:
        begin, end = self.ranges[index]
        return self.grad.slice(begin, end).to_dense()


def check_supported(loss: CachedSpladeLoss) -> None:
    """Refuse what the sparse loss stage does not compute (sentence-transformers' ``CachedSpladeLoss``
    takes any base loss and regularizer; this one computes InfoNCE on dot products and FLOPS itself).

    Raises:
        ValueError: naming the unsupported piece.
    """
    base = loss.loss
    if not isinstance(base, MultipleNegativesRankingLoss):
        raise ValueError(
            f"SparseCachedSpladeLoss computes SparseMultipleNegativesRankingLoss only, got {type(base).__name__}"
        )
    if base.similarity_fct is not dot_score:
        raise ValueError("SparseCachedSpladeLoss scores by dot product only (similarity_fct=util.dot_score)")
    if base.hardness_mode is not None and base.hardness_strength > 0:
        raise ValueError("SparseCachedSpladeLoss does not support hardness_mode")
    regularizers = [loss.document_regularizer] + (
        [loss.query_regularizer] if hasattr(loss, "query_regularizer") else []
    )
    for regularizer in regularizers:
        if type(regularizer) is not FlopsLoss:
            raise ValueError(
                f"SparseCachedSpladeLoss regularizes with FlopsLoss only, got {type(regularizer).__name__}"
            )


def flops(parts: list[SparseRows], threshold: float | None, world: int) -> torch.Tensor:
    """``sum_j (mean_i m_i w_ij)^2`` over all ranks' rows of ``parts`` (the rows of one regularized group:
    the documents, or the queries), ``m_i = [L0(w_i) > threshold]`` (1 without a threshold), as
    sentence-transformers' ``FlopsLoss`` computes it on one concatenated batch.

    With ``world > 1`` each rank passes its own rows; the column sums and the row count are all-reduced
    (two collectives), so every rank gets the same value. The gradient, to this rank's rows only, is
    scaled by ``world``: DDP averages the ranks' gradients, and the mean of ``world`` copies of this
    gradient must be the gradient of the one global term.

    Returns:
        A scalar in at least float32, differentiable in the parts' values.
    """
    sums, rows = None, 0
    for part in parts:
        weight = None if threshold is None else part.row_active() > threshold
        column = part.column_sums(weight)
        sums = column if sums is None else sums + column
        rows += part.rows
    count = torch.tensor(float(rows), dtype=torch.float64, device=sums.device)
    if world > 1:
        total = sums.detach().clone()
        dist.all_reduce(total)
        dist.all_reduce(count)
        sums = sums + (total - sums.detach())
    value = ((sums / count.to(sums.dtype)) ** 2).sum()
    return value + (world - 1) * (value - value.detach())


class SparseCachedSpladeLoss(CachedSpladeLoss):
    """sentence-transformers' ``CachedSpladeLoss`` with a sparse cache, a chunked score matrix and a global
    FLOPS term (see the module docstring). Same constructor, plus ``cache_form``.

    Args:
        model, loss, document_regularizer_weight, query_regularizer_weight, document_regularizer,
            query_regularizer, document_regularizer_threshold, query_regularizer_threshold,
            use_document_regularizer_only, mini_batch_size, mini_batch_num_tokens, show_progress_bar:
            as ``CachedSpladeLoss``; ``loss`` must be a ``SparseMultipleNegativesRankingLoss`` on
            ``dot_score`` without hardness weighting, the regularizers ``FlopsLoss`` (the defaults).
        cache_form: ``auto`` (sparse per mini-batch where it takes fewer bytes, else dense), or
            ``sparse`` / ``dense`` for every mini-batch (the same loss and gradients; for tests and benchmarks).

    Raises:
        ValueError: an unsupported base loss or regularizer (:func:`check_supported`), or an unknown
            ``cache_form``.
    """

    row_ops = SPARSE_ROWS  # a column's cached rows are SparseRows (cembed.losses.reps)

    def __init__(self, *args, cache_form: str = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_supported(self)
        if cache_form not in CACHE_FORMS:
            raise ValueError(f"cache_form must be one of {', '.join(CACHE_FORMS)}, got {cache_form!r}")
        self.cache_form = cache_form
        self.sparse_counts = SparseCounts()

    def get_config_dict(self) -> dict:
        """``CachedSpladeLoss``'s configuration (the model card's loss section) and ``cache_form``."""
        return super().get_config_dict() | {"cache_form": self.cache_form}

    def forward_cached(self, sentence_features, labels=None) -> torch.Tensor:
        """GradCache's three steps (sentence-transformers' ``CachedLossMixin.forward_cached``), each
        mini-batch's embeddings kept as :class:`SparseRows` and the cached gradient at their active
        coordinates; the replay is the library's own backward hook."""
        features = list(sentence_features)
        grad_enabled = torch.is_grad_enabled()
        ranges = [self.column_ranges(f) for f in features]
        columns, random_states = [], []
        for index, (feature, column_ranges) in enumerate(zip(features, ranges)):
            parts, states = [], []
            items = self.embed_minibatch_iter(
                sentence_feature=feature, with_grad=False, copy_random_state=grad_enabled, ranges=column_ranges
            )
            for reps, state in items:
                part = SparseRows.from_dense(reps, self.cache_form)
                self.sparse_counts.add(index, part.rows, part.active(), part.nbytes, part.is_sparse)
                parts.append(part)
                states.append(state)
            columns.append(self.to_original_order(index, assemble(parts, self.cache_form)))
            random_states.append(states)
        if not grad_enabled:
            return self.sparse_loss(columns, labels)[0]
        loss, grads = self.sparse_loss(columns, labels, with_backward=True)
        del columns
        grads = [self.to_sorted_order(index, grad) for index, grad in enumerate(grads)]
        cache = [MiniBatchGrads(grad, column_ranges) for grad, column_ranges in zip(grads, ranges)]
        loss = loss.detach().requires_grad_()
        loss.register_hook(
            partial(
                _backward_hook,
                sentence_features=features,
                loss_obj=self,
                cache=cache,
                random_states=random_states,
                ranges=ranges,
            )
        )
        return loss

    def column_ranges(self, feature: dict) -> list[tuple[int, int]]:
        """The ``(begin, end)`` mini-batches of one column: ``mini_batch_size`` rows, or the library's
        ``mini_batch_num_tokens`` budget (cembed's :class:`~cembed.losses.length_sorted.LengthSortedMixin`
        cuts its own)."""
        return _minibatch_ranges(feature, self.mini_batch_size, self.mini_batch_num_tokens)

    def to_original_order(self, index: int, column: SparseRows) -> SparseRows:
        """Column ``index``'s rows in the batch's row order: as embedded (cembed's length sorting reorders)."""
        return column

    def to_sorted_order(self, index: int, column: SparseRows) -> SparseRows:
        """The inverse of :meth:`to_original_order`."""
        return column

    def calculate_loss(self, reps, labels=None, *, with_backward: bool = False) -> torch.Tensor:
        """The ``CachedLossMixin`` contract on dense mini-batch embeddings ``reps`` (one list of
        ``(rows, width)`` tensors per column): the loss, and with ``with_backward`` each tensor's
        ``.grad`` (zero at its zero coordinates, which carry no gradient to the model)."""
        columns = [assemble([SparseRows.from_dense(r, self.cache_form) for r in col], self.cache_form) for col in reps]
        loss, grads = self.sparse_loss(columns, labels, with_backward=with_backward)
        if with_backward:
            for col, grad in zip(reps, grads):
                at = 0
                for rep in col:
                    part = grad.slice(at, at + rep.shape[0]).to_dense()
                    rep.grad = part if rep.grad is None else rep.grad + part
                    at += rep.shape[0]
        return loss

    def sparse_loss(
        self, columns: list[SparseRows], labels=None, with_backward: bool = False
    ) -> tuple[torch.Tensor, list[SparseRows] | None]:
        """The loss on this rank's columns (0: queries, then positives and negatives), and with
        ``with_backward`` the gradient of each column (same form and pattern), summed over ranks for the
        columns gathered from every rank. Sets the per-component values the trainer logs.

        Returns:
            ``(loss, grads)``: a detached scalar; ``grads`` None without ``with_backward``.
        """
        world = world_size()
        gather = self.loss.gather_across_devices and world > 1
        need_queries = bool({"query_to_query", "doc_to_query"} & set(self.loss.directions))
        gathered: list[GatheredRows | None] = [
            gather_rows(col, self.cache_form) if gather and (k > 0 or need_queries) else None
            for k, col in enumerate(columns)
        ]
        full = [col if g is None else g.rows for col, g in zip(columns, gathered)]
        starts = [0 if g is None else g.row_start for g in gathered]
        leaves = [f.with_values(f.values.detach().requires_grad_(with_backward)) for f in full]
        local = [leaf.slice(s, s + col.rows) for leaf, s, col in zip(leaves, starts, columns)]
        grad_context = torch.enable_grad() if with_backward else nullcontext()

        batch = columns[0].rows
        base = torch.zeros((), dtype=compute_dtype(columns[0].values.dtype), device=columns[0].values.device)
        for begin in range(0, batch, self.mini_batch_size):
            end = min(begin + self.mini_batch_size, batch)
            with grad_context:
                part = self.contrastive_chunk(leaves, starts, begin, end) * ((end - begin) / batch)
            if with_backward:
                part.backward()
            base = base + part.detach()

        with grad_context:
            documents = local if self.use_document_regularizer_only else local[1:]
            document_reg = flops(documents, self.document_regularizer.threshold, world)
            regularizers = {"document_regularizer_loss": document_reg * self.document_regularizer_weight}
            if self.query_regularizer_weight is not None:
                query_reg = flops(local[:1], self.query_regularizer.threshold, world)
                regularizers["query_regularizer_loss"] = query_reg * self.query_regularizer_weight
        if with_backward:
            sum(regularizers.values()).backward()
        components = {"base_loss": base} | {k: v.detach() for k, v in regularizers.items()}
        self._component_values = {key: value.item() for key, value in components.items()}
        total = sum(components.values())
        if not with_backward:
            return total, None
        grads = []
        for leaf, col, g in zip(leaves, columns, gathered):
            grad = leaf.values.grad if leaf.values.grad is not None else torch.zeros_like(leaf.values)
            grads.append(col.with_values(grad) if g is None else g.local_grad(grad))
        return total, grads

    def contrastive_chunk(self, columns: list[SparseRows], starts: list[int], begin: int, end: int) -> torch.Tensor:
        """``SparseMultipleNegativesRankingLoss`` (sentence-transformers' ``MultipleNegativesRankingLoss``
        math) for this rank's anchors ``begin:end``, against every candidate: the mean over those anchors.

        Args:
            columns: every column's rows (queries, positives, negatives), gathered where the run
                gathers; this rank's rows of column ``k`` start at row ``starts[k]``.
            begin, end: the anchors, as rows of this rank's batch.

        Returns:
            A scalar; the scores are ``(end - begin, candidates)``, both in at least float32 (:func:`compute_dtype`).
        """
        loss_cfg = self.loss
        queries, docs = columns[0], columns[1:]
        device, dtype = queries.values.device, compute_dtype(queries.values.dtype)
        rows = torch.arange(end - begin, device=device)
        own_query = starts[0] + begin + rows
        own_doc = starts[1] + begin + rows
        query_chunk = queries.slice(starts[0] + begin, starts[0] + end).to_dense(dtype)
        scores = {"query_to_doc": torch.cat([d.scores(query_chunk).to(dtype) for d in docs], dim=1)}
        if "query_to_query" in loss_cfg.directions:
            scores["query_to_query"] = (
                queries.scores(query_chunk)
                .to(dtype)
                .index_put((rows, own_query), torch.tensor(-torch.inf, device=device))
            )
        if {"doc_to_query", "doc_to_doc"} & set(loss_cfg.directions):
            doc_chunk = docs[0].slice(starts[1] + begin, starts[1] + end).to_dense(dtype)
            if "doc_to_query" in loss_cfg.directions:
                scores["doc_to_query"] = queries.scores(doc_chunk).to(dtype)
            if "doc_to_doc" in loss_cfg.directions:
                within = docs[0].rows
                own = torch.zeros(end - begin, within * len(docs), dtype=torch.bool, device=device)
                for k in range(len(docs)):
                    own[rows, k * within + own_doc] = True
                doc_scores = torch.cat([d.scores(doc_chunk).to(dtype) for d in docs], dim=1)
                scores["doc_to_doc"] = doc_scores.masked_fill(own, -torch.inf)
        scores = {key: value * loss_cfg.scale for key, value in scores.items()}
        positive = scores["query_to_doc"][rows, own_doc]
        if loss_cfg.partition_mode == "joint":
            log_z = torch.logsumexp(torch.cat(list(scores.values()), dim=1), dim=1)
        else:
            log_z = sum(torch.logsumexp(s, dim=1) for s in scores.values()) / len(scores)
        return -(positive - log_z).mean()
