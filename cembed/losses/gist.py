"""Guided false-negative filtering for the cached loss, built on sentence-transformers'
``CachedGISTEmbedLoss`` (GISTEmbed, Solatorio 2024, arXiv:2402.16829; GradCache, Gao et al. 2021,
arXiv:2101.06983).

At huge batch sizes many in-batch "negatives" are real matches of the anchor (other captions of the
same image). GISTEmbed leaves out of each anchor's softmax every candidate that a guide model scores
above the anchor's positive (``absolute``: ``g(a, c) > g(a, p) - margin``; ``relative``:
``g(a, c) > g(a, p) - |g(a, p)| * margin``, cosine scores). Two ways to get the guide's scores:

* :class:`GuidedFilterMixin` alone: a separate, frozen guide model (``loss.name: cached_gist``);
* with :class:`SelfGuidedMixin`: the model is its own guide. The cached loss's first, no-grad pass
  already embeds the whole batch, so those embeddings serve as the guide's: no second model, no extra
  forward pass (``cached_mnrl`` with ``loss.false_negative_filter``).

Both count the candidates they mask (:class:`cembed.losses.counts.FilterCounts`, read by the meter).
The losses put the mixins in front of :class:`cembed.losses.length_sorted.LengthSortedMixin`:
:class:`LengthSortedCachedGIST` is ``loss.name: cached_gist`` (registered here);
:class:`SelfGuidedCachedMNRL` is what :mod:`cembed.losses.mnrl` builds for ``cached_mnrl`` with a
``false_negative_filter``.
"""

from __future__ import annotations

import torch
from sentence_transformers.base.losses.gradcache import CachedLossMixin
from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss
from sentence_transformers.util import cos_sim, get_rank
from torch import nn

from cembed.config.loss import CachedGISTLossConfig
from cembed.losses.counts import FilterCounts
from cembed.losses.length_sorted import LengthSortedMixin
from cembed.losses.registry import LossSettings, register_loss
from cembed.model.load import load_guide_model


class CountingCrossEntropy(nn.CrossEntropyLoss):
    """GIST's cross-entropy over the ``(rows, columns)`` scores of a chunk of anchors, also counting the
    masked (``-inf``) candidates into ``counts``.

    The column layout is GIST's: anchor-positive ``[A]`` (``A`` = gathered batch), anchor-anchor ``[N]``
    (local batch, with ``contrast_anchors``), positive-positive ``[A]`` (with ``contrast_positives``),
    then one ``[A]`` block per negative column. :meth:`set_layout` gives ``N``, the candidate columns
    and the rank's ``offset`` before each loss; ``labels`` are ``offset + row``.
    """

    def __init__(self, counts: FilterCounts, contrast_anchors: bool, contrast_positives: bool) -> None:
        super().__init__()
        self.counts = counts
        self.contrast = (contrast_anchors, contrast_positives)
        self.layout = (0, 1, 0)
        self._masked: torch.Tensor | int = 0

    def set_layout(self, local_rows: int, candidate_columns: int, offset: int) -> None:
        self.layout = (local_rows, candidate_columns, offset)

    def forward(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            n_local, columns, offset = self.layout
            anchors, positives = self.contrast
            rows, width = scores.shape
            gathered = (width - anchors * n_local) // (columns + positives)
            masked = torch.isneginf(scores)
            n_masked = masked.sum()
            self_columns = []
            if anchors:
                self_columns.append(gathered + labels - offset)
            if positives:
                self_columns.append(gathered + anchors * n_local + labels)
            for cols in self_columns:
                n_masked = n_masked - masked.gather(1, cols.view(-1, 1)).sum()
            self._masked = self._masked + n_masked  # a device tensor: synchronized once per loss
            self.counts.candidates += rows * (width - 1 - len(self_columns))
        return super().forward(scores, labels)

    def flush(self) -> None:
        """Add the masked count accumulated on the device to ``counts`` (one synchronization)."""
        self.counts.masked += int(self._masked)
        self._masked = 0


class GuidedFilterMixin:
    """For a ``CachedGISTEmbedLoss`` subclass: counts the masked candidates (``filter_counts``), scores
    with one matrix product (``cos_sim``) instead of GIST's broadcast cosine, which would hold a
    ``(rows, candidates, dim)`` tensor per chunk, keeps a separate guide in eval mode and frozen, and
    puts the guide's embeddings in the model's row order when ``LengthSortedMixin`` sorted the rows
    (it records ``_inverse``).

    Put it first in the bases: ``class X(GuidedFilterMixin, LengthSortedMixin, CachedGISTEmbedLoss)``.
    """

    guide: nn.Module
    model: nn.Module
    gather_across_devices: bool
    cross_entropy_loss: nn.Module

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.filter_counts = FilterCounts()
        self.cross_entropy_loss = CountingCrossEntropy(
            self.filter_counts, self.contrast_anchors, self.contrast_positives
        )
        if self.guide is not self.model:
            self.guide.requires_grad_(False)
            self.guide.eval()

    def train(self, mode: bool = True):
        """Train mode for the loss and the model; a separate guide stays in eval mode (no dropout)."""
        super().train(mode)
        if self.guide is not self.model:
            self.guide.eval()
        return self

    def sim_matrix(self, embed1: torch.Tensor, embed2: torch.Tensor) -> torch.Tensor:
        """Cosine similarities ``(len(embed1), len(embed2))`` by normalized matrix product."""
        return cos_sim(embed1, embed2)

    def calculate_loss(self, reps, reps_guided, *, with_backward: bool = False):
        """GIST's loss over the whole batch (chunked), with the guide's embeddings in row order.

        Args:
            reps: per column, the model's mini-batch embeddings ``(rows, dim)`` (sorted order).
            reps_guided: per column, the guide's mini-batch embeddings (same order as ``reps``).
        """
        inverse = getattr(self, "_inverse", [])
        if any(inv is not None for inv in inverse):
            reps_guided = [
                col if inv is None else [torch.cat(col).index_select(0, inv.to(col[0].device))]
                for col, inv in zip(reps_guided, inverse)
            ]
        n_local = sum(r.shape[0] for r in reps[0])
        offset = get_rank() * n_local if self.gather_across_devices else 0
        self.cross_entropy_loss.set_layout(n_local, len(reps) - 1, offset)
        loss = super().calculate_loss(reps, reps_guided, with_backward=with_backward)
        self.cross_entropy_loss.flush()
        return loss

    def get_config_dict(self) -> dict:
        """The library's config, naming the guide instead of holding the model."""
        config = super().get_config_dict()
        config["guide"] = "self" if self.guide is self.model else type(self.guide).__name__
        return config


class SelfGuidedMixin:
    """The model is its own guide: the guide's embeddings of a mini-batch are the model's own from the
    no-grad pass (detached), so filtering costs no second model and no extra forward pass.

    Build the loss with ``guide=model``; put this mixin before ``CachedGISTEmbedLoss`` in the bases.
    """

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        """``(embeddings, guide embeddings or None in the with-grad pass, RandContext)``.

        The library's one-model ``embed_minibatch`` (``CachedGISTEmbedLoss``'s would run the model a
        second time as the guide). Packed or padded is not decided here:
        :meth:`cembed.losses.length_sorted.LengthSortedMixin.embed_minibatch_iter` runs this whole call
        with the encoder on the mini-batch's packs."""
        reps, state = CachedLossMixin.embed_minibatch(
            self, sentence_feature, begin, end, with_grad, copy_random_state, random_state
        )
        return reps, (None if with_grad else reps.detach()), state


class LengthSortedCachedGIST(GuidedFilterMixin, LengthSortedMixin, CachedGISTEmbedLoss):
    """``CachedGISTEmbedLoss`` (guide model) with length-sorted mini-batches and a count of the
    candidates the guide masked (:class:`GuidedFilterMixin`)."""


class SelfGuidedCachedMNRL(GuidedFilterMixin, SelfGuidedMixin, LengthSortedMixin, CachedGISTEmbedLoss):
    """InfoNCE with GradCache whose in-batch false negatives are masked by the model's own no-grad
    embeddings (:class:`SelfGuidedMixin`); build it with ``guide=model``, ``contrast_anchors=False``
    and ``contrast_positives=False``: the loss is then ``cached_mnrl``'s with the masked candidates
    left out of each softmax."""


def build_cached_gist(model, cfg: CachedGISTLossConfig, settings: LossSettings) -> nn.Module:
    """The ``cached_gist`` builder: load ``cfg.guide`` on the model's device and build
    :class:`LengthSortedCachedGIST` with the run's mini-batching (:meth:`LossSettings.cached_kwargs`).

    Raises:
        UserError: ``loss.guide`` cannot be loaded (:func:`cembed.model.load.load_guide_model`).
    """
    guide = load_guide_model(cfg.guide, model.device, cfg.guide_max_seq_length)
    return LengthSortedCachedGIST(
        model,
        guide,
        temperature=cfg.temperature,
        margin_strategy=cfg.margin_strategy,
        margin=cfg.margin,
        contrast_anchors=cfg.contrast_anchors,
        contrast_positives=cfg.contrast_positives,
        **settings.cached_kwargs(),
    )


register_loss(CachedGISTLossConfig, build_cached_gist)
