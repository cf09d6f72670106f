"""``cached_splade``: SPLADE's contrastive loss with FLOPS regularizers for a sparse model, with GradCache;
registered here.

The loss is :class:`cembed.losses.cached_splade.SparseCachedSpladeLoss` (sentence-transformers'
``CachedSpladeLoss`` with a cache of each row's active coordinates, a chunked score matrix and a FLOPS
term over the global batch) behind cembed's :class:`~cembed.losses.length_sorted.LengthSortedMixin`:
each column is length-sorted, cut by ``mini_batch_size`` rows or the token budget and packed where the
model allows it (SPLADE pools each packed row over its own positions: the packing scatters the MLM
logits back per row before ``SpladePooling``); the sorted rows are put back in order as
:class:`~cembed.losses.sparse_rows.SparseRows` (the loss's ``row_ops``), never as dense vocabulary-wide rows.

The regularizer weights' warm-up is sentence-transformers' ``SpladeRegularizerWeightSchedulerCallback``
(:func:`regularizer_warmup`), which the trainer of the sparse kind runs.
"""

from __future__ import annotations

import torch
from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss
from torch import nn

from cembed.config.loss import CachedSpladeLossConfig
from cembed.losses.cached_splade import SparseCachedSpladeLoss
from cembed.losses.length_sorted import LengthSortedMixin
from cembed.losses.registry import LossSettings, register_loss


class LengthSortedCachedSplade(LengthSortedMixin, SparseCachedSpladeLoss):
    """:class:`SparseCachedSpladeLoss` with cembed's length-sorted, token-budget, packed mini-batches."""

    def replicate_minibatch(self, outputs: tuple, sizes: list[int]) -> list[list]:
        """The probe's cache (:mod:`cembed.probe.worst_case`) at the dense worst case: one mini-batch's rows
        with every coordinate active (a zero becomes the smallest positive float32), as a fresh
        masked-language model's are, so every cached mini-batch and the loss stage take the dense form
        (the most memory the cache can hold), whatever this model's density."""
        tiny = torch.finfo(torch.float32).tiny
        rows = [e.detach().float() for e in outputs]
        rows = [torch.where(e == 0, torch.full_like(e, tiny), e) if e.is_floating_point() else e for e in rows]
        return [[full[:n] for n in sizes] for full in rows]


def regularizer_warmup(loss: nn.Module, cfg: CachedSpladeLossConfig):
    """sentence-transformers' ``SpladeRegularizerWeightSchedulerCallback`` for ``loss`` with ``cfg``'s schedule:
    the regularizer weights rise from 0 to ``cfg.*_regularizer_weight`` over the first
    ``cfg.regularizer_warmup_ratio`` of the steps (quadratically or linearly), from the trainer's step, so a
    resumed run picks it up where it was."""
    from sentence_transformers.sparse_encoder.callbacks.splade_callbacks import SpladeRegularizerWeightSchedulerCallback

    return SpladeRegularizerWeightSchedulerCallback(
        loss, scheduler_type=cfg.regularizer_schedule, warmup_ratio=cfg.regularizer_warmup_ratio
    )


def build_cached_splade(model, cfg: CachedSpladeLossConfig, settings: LossSettings) -> nn.Module:
    """The ``cached_splade`` builder: :class:`LengthSortedCachedSplade` on a ``SparseMultipleNegativesRankingLoss``
    at ``cfg.scale`` (gathering the documents across ranks with the settings), FLOPS regularizers with
    ``cfg``'s weights and thresholds; the module's ``trainer_callbacks`` hold its weights' warm-up
    (:func:`regularizer_warmup`)."""
    base = SparseMultipleNegativesRankingLoss(
        model,
        scale=cfg.scale,
        gather_across_devices=settings.gather_across_devices,
        directions=cfg.resolved_directions(),
        partition_mode=cfg.partition_mode,
    )
    loss = LengthSortedCachedSplade(
        model,
        loss=base,
        document_regularizer_weight=cfg.document_regularizer_weight,
        query_regularizer_weight=cfg.query_regularizer_weight,
        document_regularizer_threshold=cfg.document_regularizer_threshold,
        query_regularizer_threshold=cfg.query_regularizer_threshold,
        use_document_regularizer_only=cfg.use_document_regularizer_only,
        mini_batch_size=settings.mini_batch_size,
        mini_batch_num_tokens=settings.mini_batch_num_tokens,
        sort_by_length=settings.sort_by_length,
        unpad=settings.unpad,
        cache_form=cfg.cache_form,
    )
    loss.trainer_callbacks = [regularizer_warmup(loss, cfg)]
    return loss


register_loss(CachedSpladeLossConfig, build_cached_splade)
