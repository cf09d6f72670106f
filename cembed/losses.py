"""The in-batch-negatives losses, built from sentence-transformers.

``cached_mnrl`` is sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (GradCache, Gao et
al. 2021, arXiv:2101.06983): memory depends on ``mini_batch_size`` only, the loss and gradients do
not. cembed subclasses it to sort each column's rows by token length before cutting mini-batches
(:class:`LengthSortedCachedMNRL`), which removes most padded positions without changing the loss.
``mnrl`` is the plain ``MultipleNegativesRankingLoss`` (InfoNCE with in-batch negatives, Henderson
et al. 2017, arXiv:1705.00652).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sentence_transformers.base.losses.gradcache import _minibatch_ranges
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)

from cembed.config import LossConfig


@dataclass
class TokenCounts:
    """Token positions seen by the loss since the last :meth:`reset` (read by the meter)."""

    real: int = 0  # non-padding tokens
    processed: int = 0  # positions the encoder ran on (rows x padded width, per mini-batch)

    def reset(self) -> None:
        self.real = self.processed = 0


def _count_tokens(feature: dict, ranges: list[tuple[int, int]] | None, counts: TokenCounts) -> None:
    mask = feature.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        return
    lengths = mask.sum(dim=1)
    counts.real += int(lengths.sum())
    if ranges is None:  # one forward over the whole column, padded to its longest row
        counts.processed += mask.shape[0] * int(lengths.max())
        return
    # sentence-transformers trims each mini-batch to its longest row (trailing padding only).
    for begin, end in ranges:
        counts.processed += (end - begin) * int(lengths[begin:end].max())


def _take_rows(feature: dict, order: torch.Tensor) -> dict:
    n = order.numel()
    return {
        k: (
            v.index_select(0, order.to(v.device))
            if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == n
            else v
        )
        for k, v in feature.items()
    }


class LengthSortedCachedMNRL(CachedMultipleNegativesRankingLoss):
    """``CachedMultipleNegativesRankingLoss`` with each column's rows sorted by token length
    (longest first) before they are cut into mini-batches.

    The embeddings are put back in the original row order before the loss, so loss and gradients
    equal the unsorted loss's (the positive of row i stays on the diagonal) while mini-batches of
    similar lengths carry little padding. Longest first also makes the first mini-batch the
    memory worst case. ``mini_batch_num_tokens`` (sentence-transformers' token-budget mini-batches)
    works on the sorted rows.
    """

    def __init__(self, *args, sort_by_length: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sort_by_length = sort_by_length
        self.token_counts = TokenCounts()
        self._inverse: list[torch.Tensor | None] = []

    def forward(self, sentence_features, labels):
        features = list(sentence_features)
        self._inverse = []
        if self.sort_by_length:
            sorted_features = []
            for feature in features:
                mask = feature.get("attention_mask")
                if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
                    sorted_features.append(feature)
                    self._inverse.append(None)
                    continue
                order = torch.argsort(mask.sum(dim=1), descending=True, stable=True)
                inverse = torch.empty_like(order)
                inverse[order] = torch.arange(order.numel(), device=order.device)
                sorted_features.append(_take_rows(feature, order))
                self._inverse.append(inverse)
            features = sorted_features
        for feature in features:
            ranges = _minibatch_ranges(feature, self.mini_batch_size, self.mini_batch_num_tokens)
            _count_tokens(feature, ranges, self.token_counts)
        return super().forward(features, labels)

    def calculate_loss(self, reps, labels=None, *, with_backward: bool = False):
        """Run the parent's loss on the embeddings in original row order.

        The parent back-propagates chunk by chunk, so the reordering cannot be a shared autograd
        graph: each column is reordered into a fresh leaf, and the leaf's gradient is scattered
        back onto the sorted mini-batch embeddings whose ``.grad`` is the GradCache cache.
        """
        if not any(inv is not None for inv in self._inverse):
            return super().calculate_loss(reps, labels, with_backward=with_backward)
        leaves: list[torch.Tensor | None] = []
        ordered = []
        for col, inv in zip(reps, self._inverse):
            if inv is None:
                leaves.append(None)
                ordered.append(col)
                continue
            # leaf[j] = embedding of original row j = sorted row inv[j]
            leaf = torch.cat([r.detach() for r in col]).index_select(0, inv.to(col[0].device))
            if with_backward:
                leaf.requires_grad_()
            leaves.append(leaf)
            ordered.append([leaf])
        loss = super().calculate_loss(ordered, labels, with_backward=with_backward)
        if with_backward:
            for col, inv, leaf in zip(reps, self._inverse, leaves):
                if leaf is None or leaf.grad is None:
                    continue
                grad_sorted = torch.empty_like(leaf.grad)
                grad_sorted[inv.to(leaf.device)] = leaf.grad
                for rep, grad in zip(col, grad_sorted.split([r.shape[0] for r in col])):
                    rep.grad = grad if rep.grad is None else rep.grad + grad
        return loss


class CountingMNRL(MultipleNegativesRankingLoss):
    """Plain ``MultipleNegativesRankingLoss`` that also counts real vs processed token positions."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.token_counts = TokenCounts()

    def forward(self, sentence_features, labels):
        features = list(sentence_features)
        for feature in features:
            _count_tokens(feature, None, self.token_counts)
        return super().forward(features, labels)


def loss_directions(symmetric: bool) -> tuple[str, ...]:
    """``query_to_doc`` (standard InfoNCE), plus ``doc_to_query`` when ``symmetric``."""
    return ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)


def build_loss(
    model,
    cfg: LossConfig,
    mini_batch_size: int,
    gather_across_devices: bool = False,
    mini_batch_num_tokens: int | None = None,
    sort_by_length: bool = True,
):
    """Build the configured loss for ``model``.

    Args:
        model: a SentenceTransformer.
        cfg: the ``loss`` config section (name, scale = 1/temperature, symmetric).
        mini_batch_size: rows embedded at once by the cached loss (memory only, never the result).
        gather_across_devices: gather embeddings from all ranks so each anchor sees every rank's
            candidates.
        mini_batch_num_tokens: if set, the cached loss packs mini-batches by non-padding tokens.
        sort_by_length: sort each column by token length before cutting mini-batches.

    Returns:
        An ``nn.Module`` loss usable by ``SentenceTransformerTrainer``; it has a ``token_counts``
        attribute (:class:`TokenCounts`).
    """
    common = dict(
        scale=cfg.scale, gather_across_devices=gather_across_devices, directions=loss_directions(cfg.symmetric)
    )
    if cfg.name == "cached_mnrl":
        return LengthSortedCachedMNRL(
            model,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            sort_by_length=sort_by_length,
            **common,
        )
    return CountingMNRL(model, **common)
