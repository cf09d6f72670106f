"""``cached_mnrl`` and ``mnrl``: InfoNCE with in-batch negatives (``MultipleNegativesRankingLoss``,
Henderson et al. 2017, arXiv:1705.00652), each registered here.

* ``cached_mnrl`` is sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (GradCache, Gao
  et al. 2021, arXiv:2101.06983): memory depends on ``mini_batch_size`` only, the loss and gradients
  do not. cembed sorts each column's rows by token length before cutting mini-batches
  (:class:`cembed.losses.length_sorted.LengthSortedMixin`), which removes most padded positions
  without changing the loss. With ``loss.false_negative_filter`` it is
  :class:`cembed.losses.gist.SelfGuidedCachedMNRL` (the model guides its own filter);
* ``mnrl`` is the plain loss, the whole batch embedded at once.

Both take the library's ``directions`` / ``partition_mode`` / ``hardness_*`` options.
"""

from __future__ import annotations

from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)
from torch import nn

from cembed.config.loss import CachedMNRLLossConfig, MNRLLossConfig
from cembed.losses.counts import TokenCounts, count_tokens
from cembed.losses.gist import SelfGuidedCachedMNRL
from cembed.losses.length_sorted import LengthSortedMixin
from cembed.losses.registry import LossSettings, register_loss


class LengthSortedCachedMNRL(LengthSortedMixin, CachedMultipleNegativesRankingLoss):
    """``CachedMultipleNegativesRankingLoss`` with length-sorted mini-batches (:class:`LengthSortedMixin`)."""


class CountingMNRL(MultipleNegativesRankingLoss):
    """Plain ``MultipleNegativesRankingLoss`` that also counts real vs processed token positions."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.token_counts = TokenCounts()

    def forward(self, sentence_features, labels):
        """Count the tokens of each column (one padded forward each), then run the plain loss."""
        features = list(sentence_features)
        for feature in features:
            count_tokens(feature, None, self.token_counts)
        return super().forward(features, labels)


def _mnrl_kwargs(cfg: MNRLLossConfig | CachedMNRLLossConfig, settings: LossSettings) -> dict:
    return dict(
        scale=cfg.scale,
        gather_across_devices=settings.gather_across_devices,
        directions=cfg.resolved_directions(),
        partition_mode=cfg.partition_mode,
        hardness_mode=cfg.hardness_mode,
        hardness_strength=cfg.hardness_strength,
    )


def build_cached_mnrl(model, cfg: CachedMNRLLossConfig, settings: LossSettings) -> nn.Module:
    """The ``cached_mnrl`` builder: :class:`LengthSortedCachedMNRL`, or with
    ``cfg.false_negative_filter`` a :class:`~cembed.losses.gist.SelfGuidedCachedMNRL` at temperature
    ``1 / scale`` (the same softmax, less the masked candidates)."""
    if cfg.false_negative_filter is not None:
        return SelfGuidedCachedMNRL(
            model,
            model,
            temperature=1.0 / cfg.scale,
            margin_strategy=cfg.false_negative_filter.strategy,
            margin=cfg.false_negative_filter.margin,
            contrast_anchors=False,
            contrast_positives=False,
            **settings.cached_kwargs(),
        )
    kwargs = settings.cached_kwargs() | _mnrl_kwargs(cfg, settings)
    return LengthSortedCachedMNRL(model, **kwargs)


def build_mnrl(model, cfg: MNRLLossConfig, settings: LossSettings) -> nn.Module:
    """The ``mnrl`` builder: :class:`CountingMNRL` (the settings' mini-batching does not apply)."""
    return CountingMNRL(model, **_mnrl_kwargs(cfg, settings))


register_loss(CachedMNRLLossConfig, build_cached_mnrl)
register_loss(MNRLLossConfig, build_mnrl)
