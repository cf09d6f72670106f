"""The contrastive losses, and the seam a new loss plugs into.

The contract. A loss is three things, and nothing else in cembed names it:

* a config class, a subclass of :class:`cembed.config.schema.LossConfig` with
  ``name: Literal["<name>"] = "<name>"``, its own fields, and the class-level capability
  ``uses_gradient_cache`` (True when it embeds in mini-batches of ``mini_batch_size`` rows);
* a builder ``builder(model, cfg, settings: LossSettings) -> nn.Module``: ``cfg`` is the validated
  config instance, ``settings`` the run's mini-batching and gathering (:class:`LossSettings`). The
  module is called by the sentence-transformers trainer as ``module(features, labels)``, where
  ``features`` holds one dict per input column (anchor, positive, negatives...) with
  ``input_ids`` / ``attention_mask`` of shape ``(rows, seq_len)``, and it returns a scalar loss.
  The model turns a feature dict into ``sentence_embedding`` of shape ``(rows, dim)``. A module
  should carry ``token_counts`` (:class:`TokenCounts`) for the throughput meter. A module whose
  ``uses_gradient_cache`` is True must be a sentence-transformers ``CachedLossMixin`` loss
  (``embed_minibatch``, ``calculate_loss``): the probe measures its memory with them;
* one :func:`register_loss` call. :func:`build_loss` then returns a :class:`BuiltLoss`.

The built-in losses are both InfoNCE with in-batch negatives (``MultipleNegativesRankingLoss``,
Henderson et al. 2017, arXiv:1705.00652):

* ``cached_mnrl`` is sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (GradCache, Gao
  et al. 2021, arXiv:2101.06983): memory depends on ``mini_batch_size`` only, the loss and gradients
  do not. cembed sorts each column's rows by token length before cutting mini-batches
  (:class:`LengthSortedMixin`), which removes most padded positions without changing the loss;
* ``mnrl`` is the plain loss, the whole batch embedded at once.

Both take the library's ``directions`` / ``partition_mode`` / ``hardness_*`` options. ``cached_mnrl``
with ``false_negative_filter`` builds :class:`SelfGuidedCachedMNRL` and ``cached_gist``
:class:`LengthSortedCachedGIST` (both on ``CachedGISTEmbedLoss``, :mod:`cembed.losses.guided`);
``loss.matryoshka`` wraps any of them in :class:`cembed.losses.matryoshka.CountingMatryoshkaLoss`.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, get_args

import torch
from sentence_transformers.base.losses.gradcache import _minibatch_ranges, uses_gradient_cache  # noqa: F401 - re-exported
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)
from torch import nn

from cembed.config.loss import CachedGISTLossConfig
from cembed.config.schema import CachedMNRLLossConfig, LossConfig, MNRLLossConfig, register_loss_config
from cembed.losses.counts import TokenCounts, _count_tokens  # noqa: F401 - _count_tokens is re-exported
from cembed.losses.guided import FilterCounts, GuidedFilterMixin, SelfGuidedMixin
from cembed.losses.length_sorted import LengthSortedMixin, _take_rows  # noqa: F401 - _take_rows is re-exported
from cembed.losses.matryoshka import CountingMatryoshkaLoss
from cembed.model.load import load_guide_model
from cembed.model.unpad import Unpadding, UnpadSetting


@contextmanager
def simulated_gather(loss, world_size: int):
    """Inside the block, ``loss``'s cross-rank gathers (``all_gather_with_grad`` / ``all_gather``
    as its modules imported them) return ``world_size`` local copies of the tensor instead of
    gathering: the memory of ``world_size`` ranks' candidates, with gradients, and no collective
    (probe trials run a different number of times on different ranks)."""

    def copies(tensor, *args, **kwargs):
        return torch.cat([tensor] * world_size)

    patched = []
    for cls in type(loss).__mro__:
        module = sys.modules.get(cls.__module__)
        for name in ("all_gather_with_grad", "all_gather"):
            if module is not None and callable(getattr(module, name, None)):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, copies)
    try:
        yield
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)


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
            _count_tokens(feature, None, self.token_counts)
        return super().forward(features, labels)


class LengthSortedCachedGIST(GuidedFilterMixin, LengthSortedMixin, CachedGISTEmbedLoss):
    """``CachedGISTEmbedLoss`` (guide model) with length-sorted mini-batches and a count of the
    candidates the guide masked (:class:`cembed.losses.guided.GuidedFilterMixin`)."""


class SelfGuidedCachedMNRL(GuidedFilterMixin, SelfGuidedMixin, LengthSortedMixin, CachedGISTEmbedLoss):
    """InfoNCE with GradCache whose in-batch false negatives are masked by the model's own no-grad
    embeddings (:class:`cembed.losses.guided.SelfGuidedMixin`); build it with ``guide=model``,
    ``contrast_anchors=False`` and ``contrast_positives=False``: the loss is then ``cached_mnrl``'s
    with the masked candidates left out of each softmax."""


def loss_directions(symmetric: bool) -> tuple[str, ...]:
    """``query_to_doc`` (standard InfoNCE), plus ``doc_to_query`` when ``symmetric``."""
    return ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)


# ----------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class LossSettings:
    """What a builder gets besides its config: the run's mini-batching and gathering.

    Attributes:
        mini_batch_size: rows embedded at once by a cached loss (memory only, never the result).
        gather_across_devices: gather embeddings from all ranks so each anchor sees every rank's
            candidates (already resolved from ``loss.gather_across_devices`` and the world size).
        mini_batch_num_tokens: if set, a cached loss packs mini-batches by non-padding tokens.
        sort_by_length: sort each column by token length before cutting mini-batches.
        unpad: pack a cached loss's mini-batches without padding (``auto``: where the model
            supports it; see :func:`cembed.model.unpad.resolve_unpad`).
    """

    mini_batch_size: int
    gather_across_devices: bool = False
    mini_batch_num_tokens: int | None = None
    sort_by_length: bool = True
    unpad: UnpadSetting = "auto"


LossBuilder = Callable[..., nn.Module]  # (model, cfg: LossConfig, settings: LossSettings) -> nn.Module

# name -> builder; filled by register_loss.
LOSS_BUILDERS: dict[str, LossBuilder] = {}


@dataclass
class BuiltLoss:
    """A loss ready for the trainer.

    Attributes:
        module: the ``nn.Module`` the trainer calls as ``module(features, labels)``.
        token_counts: the module's token counter (a fresh, never-filled one if it has none).
        cached: whether the module defers its backward to GradCache mini-batches
            (sentence-transformers' ``uses_gradient_cache``).
        filter_counts: candidates scored and masked as false negatives, for a filtering loss.
        unpadding: which attention path the module's mini-batches take (padded when it has none).
    """

    module: nn.Module
    token_counts: TokenCounts
    cached: bool
    filter_counts: FilterCounts | None = None
    unpadding: Unpadding = Unpadding(False, "padded (the loss embeds whole columns)")


def register_loss(config_cls: type[LossConfig], builder: LossBuilder) -> LossBuilder:
    """Make ``loss.name: <name>`` usable: register ``config_cls`` (see
    :func:`cembed.config.schema.register_loss_config`) and its ``builder`` under the config's name.

    Returns:
        ``builder``, unchanged.

    Raises:
        TypeError, ValueError: see :func:`cembed.config.schema.register_loss_config`.
    """
    register_loss_config(config_cls)
    (name,) = get_args(config_cls.model_fields["name"].annotation)
    LOSS_BUILDERS[name] = builder
    return builder


def _mnrl_kwargs(cfg: MNRLLossConfig | CachedMNRLLossConfig, settings: LossSettings) -> dict:
    return dict(
        scale=cfg.scale,
        gather_across_devices=settings.gather_across_devices,
        directions=cfg.resolved_directions(),
        partition_mode=cfg.partition_mode,
        hardness_mode=cfg.hardness_mode,
        hardness_strength=cfg.hardness_strength,
    )


def _cached_kwargs(settings: LossSettings) -> dict:
    return dict(
        mini_batch_size=settings.mini_batch_size,
        mini_batch_num_tokens=settings.mini_batch_num_tokens,
        sort_by_length=settings.sort_by_length,
        unpad=settings.unpad,
        gather_across_devices=settings.gather_across_devices,
    )


def _build_cached_gist(model, cfg: CachedGISTLossConfig, settings: LossSettings) -> nn.Module:
    guide = load_guide_model(cfg.guide, model.device, cfg.guide_max_seq_length)
    return LengthSortedCachedGIST(
        model,
        guide,
        temperature=cfg.temperature,
        margin_strategy=cfg.margin_strategy,
        margin=cfg.margin,
        contrast_anchors=cfg.contrast_anchors,
        contrast_positives=cfg.contrast_positives,
        **_cached_kwargs(settings),
    )


def _build_cached_mnrl(model, cfg: CachedMNRLLossConfig, settings: LossSettings) -> nn.Module:
    if cfg.false_negative_filter is not None:
        return SelfGuidedCachedMNRL(
            model,
            model,
            temperature=1.0 / cfg.scale,
            margin_strategy=cfg.false_negative_filter.strategy,
            margin=cfg.false_negative_filter.margin,
            contrast_anchors=False,
            contrast_positives=False,
            **_cached_kwargs(settings),
        )
    kwargs = _cached_kwargs(settings) | _mnrl_kwargs(cfg, settings)
    return LengthSortedCachedMNRL(model, **kwargs)


def _build_mnrl(model, cfg: MNRLLossConfig, settings: LossSettings) -> nn.Module:
    return CountingMNRL(model, **_mnrl_kwargs(cfg, settings))


register_loss(CachedMNRLLossConfig, _build_cached_mnrl)
register_loss(MNRLLossConfig, _build_mnrl)
register_loss(CachedGISTLossConfig, _build_cached_gist)


def build_loss(
    model,
    loss_cfg: LossConfig,
    mini_batch_size: int,
    gather_across_devices: bool = False,
    mini_batch_num_tokens: int | None = None,
    sort_by_length: bool = True,
    unpad: UnpadSetting = "auto",
) -> BuiltLoss:
    """Build the configured loss for ``model`` through the builder registered for ``loss_cfg.name``.

    Args:
        model: a SentenceTransformer.
        loss_cfg: the ``loss`` config section (a registered :class:`LossConfig` subclass).
        mini_batch_size: rows embedded at once by a cached loss (memory only, never the result).
        gather_across_devices: gather embeddings from all ranks so each anchor sees every rank's
            candidates.
        mini_batch_num_tokens: if set, a cached loss packs mini-batches by non-padding tokens.
        sort_by_length: sort each column by token length before cutting mini-batches.
        unpad: ``auto`` / True / False: pack a cached loss's mini-batches without padding
            (:func:`cembed.model.unpad.resolve_unpad`).

    Returns:
        A :class:`BuiltLoss`: the module for ``SentenceTransformerTrainer``, its token counter and
        whether it caches gradients.

    Raises:
        ValueError: no builder is registered for ``loss_cfg.name``.
        TypeError: the module's ``uses_gradient_cache`` contradicts the config class's.
        UserError: ``loss.guide`` cannot be loaded, or ``loss.matryoshka.dims`` exceed the model's size.
        ModelRefused: ``unpad`` is True and the model cannot run packed rows.
    """
    builder = LOSS_BUILDERS.get(loss_cfg.name)
    if builder is None:
        raise ValueError(f"no builder registered for loss {loss_cfg.name!r}; known: {', '.join(LOSS_BUILDERS)}")
    settings = LossSettings(mini_batch_size, gather_across_devices, mini_batch_num_tokens, sort_by_length, unpad)
    module = builder(model, loss_cfg, settings)
    if loss_cfg.matryoshka is not None:
        module = CountingMatryoshkaLoss(model, module, loss_cfg.matryoshka.dims, loss_cfg.matryoshka.weights)
    cached = bool(uses_gradient_cache(module))
    if cached != type(loss_cfg).uses_gradient_cache:
        raise TypeError(
            f"loss {loss_cfg.name!r}: the built {type(module).__name__} has uses_gradient_cache={cached}, but "
            f"{type(loss_cfg).__name__}.uses_gradient_cache is {type(loss_cfg).uses_gradient_cache}"
        )
    token_counts = getattr(module, "token_counts", None)
    if not isinstance(token_counts, TokenCounts):
        token_counts = TokenCounts()
    filter_counts = getattr(module, "filter_counts", None)
    unpadding = getattr(module, "unpadding", None)
    return BuiltLoss(
        module,
        token_counts,
        cached,
        filter_counts if isinstance(filter_counts, FilterCounts) else None,
        unpadding if isinstance(unpadding, Unpadding) else BuiltLoss.unpadding,
    )
