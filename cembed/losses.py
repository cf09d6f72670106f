"""The in-batch-negatives losses, built from sentence-transformers.

``cached_mnrl`` is sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (GradCache, Gao et
al. 2021, arXiv:2101.06983): memory depends on ``mini_batch_size`` only, the loss and gradients do
not. ``mnrl`` is the plain ``MultipleNegativesRankingLoss`` (InfoNCE with in-batch negatives,
Henderson et al. 2017, arXiv:1705.00652).
"""

from __future__ import annotations

from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)

from cembed.config import LossConfig


def loss_directions(symmetric: bool) -> tuple[str, ...]:
    """``query_to_doc`` (standard InfoNCE), plus ``doc_to_query`` when ``symmetric``."""
    return ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)


def build_loss(model, cfg: LossConfig, mini_batch_size: int, gather_across_devices: bool = False):
    """Build the configured loss for ``model``.

    Args:
        model: a SentenceTransformer.
        cfg: the ``loss`` config section (name, scale = 1/temperature, symmetric).
        mini_batch_size: rows embedded at once by the cached loss (memory only, never the result).
        gather_across_devices: gather embeddings from all ranks so each anchor sees every rank's
            candidates.

    Returns:
        An ``nn.Module`` loss usable by ``SentenceTransformerTrainer``.
    """
    common = dict(scale=cfg.scale, gather_across_devices=gather_across_devices, directions=loss_directions(cfg.symmetric))
    if cfg.name == "cached_mnrl":
        return CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size, **common)
    return MultipleNegativesRankingLoss(model, **common)
