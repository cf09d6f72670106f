"""The contrastive losses, and the seam a new loss plugs into.

The contract. A loss is three things, and nothing else in cembed names it:

* a config class, a subclass of :class:`cembed.config.LossConfig` with
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
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, get_args

import torch
from sentence_transformers.base.losses.gradcache import _minibatch_ranges, uses_gradient_cache
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)
from torch import nn

from cembed.config import CachedMNRLLossConfig, LossConfig, MNRLLossConfig, register_loss_config
from cembed.unpad import PackRegistry, Unpadding, UnpadSetting, packed_encoder, resolve_unpad


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


class LengthSortedMixin:
    """Sorts each column's rows by token length (longest first) before a cached loss cuts them
    into mini-batches, and counts real vs processed token positions (``token_counts``).

    Put it before a sentence-transformers ``CachedLossMixin`` loss in the bases, e.g.
    ``class LengthSortedCachedGIST(LengthSortedMixin, CachedGISTEmbedLoss): pass``; the constructor
    takes ``sort_by_length`` (default True) on top of the loss's own arguments.

    The embeddings are put back in the original row order before the loss, so loss and gradients
    equal the unsorted loss's (the positive of row i stays on the diagonal) while mini-batches of
    similar lengths carry little padding. Longest first also makes the first mini-batch the
    memory worst case. ``mini_batch_num_tokens`` (sentence-transformers' token-budget mini-batches)
    works on the sorted rows.

    With ``unpad`` (``auto``: where the model supports it, see :func:`cembed.unpad.resolve_unpad`)
    each mini-batch's rows are packed without padding (:mod:`cembed.unpad`); the plans are made once
    per column in :meth:`forward` and replayed by the second (gradient) pass, so both passes pack
    alike and draw the same dropout masks. ``unpadding`` says which path runs.
    """

    mini_batch_size: int
    mini_batch_num_tokens: int | None
    model: nn.Module

    def __init__(self, *args, sort_by_length: bool = True, unpad: UnpadSetting = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sort_by_length = sort_by_length
        self.token_counts = TokenCounts()
        self._inverse: list[torch.Tensor | None] = []
        self.unpadding: Unpadding = resolve_unpad(self.model, unpad)
        self._packs = PackRegistry(self.unpadding)

    def forward(self, sentence_features, labels):
        """Sort each column by length, count its tokens per mini-batch, then run the cached loss."""
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
        self._packs.reset()
        for feature in features:
            ranges = _minibatch_ranges(feature, self.mini_batch_size, self.mini_batch_num_tokens)
            plans = self._packs.plan_column(feature, ranges) if self.unpadding.enabled else None
            if plans is None:
                _count_tokens(feature, ranges, self.token_counts)
            else:  # the positions the encoder runs on are the packs'
                self.token_counts.real += sum(p.real for p in plans)
                self.token_counts.processed += sum(p.processed for p in plans)
        return super().forward(features, labels)

    def embed_minibatch(self, sentence_feature, begin, end, *args, **kwargs):
        """The parent's ``embed_minibatch``, inside :func:`cembed.unpad.packed_encoder` when this
        mini-batch is packed (same arguments and result: ``(embeddings (rows, dim), random state)``)."""
        plan = self._packs.plan_for(sentence_feature, begin, end) if self.unpadding.enabled else None
        if plan is None:
            return super().embed_minibatch(sentence_feature, begin, end, *args, **kwargs)
        with packed_encoder(self.model, plan, self.unpadding):
            return super().embed_minibatch(sentence_feature, begin, end, *args, **kwargs)

    def calculate_loss(self, reps, labels=None, *, with_backward: bool = False):
        """Run the parent's loss on the embeddings in original row order.

        The parent may back-propagate chunk by chunk, so the reordering cannot be a shared autograd
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
            supports it; see :func:`cembed.unpad.resolve_unpad`).
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
        unpadding: which attention path the module's mini-batches take (padded when it has none).
    """

    module: nn.Module
    token_counts: TokenCounts
    cached: bool
    unpadding: Unpadding = Unpadding(False, "padded (the loss embeds whole columns)")


def register_loss(config_cls: type[LossConfig], builder: LossBuilder) -> LossBuilder:
    """Make ``loss.name: <name>`` usable: register ``config_cls`` (see
    :func:`cembed.config.register_loss_config`) and its ``builder`` under the config's name.

    Returns:
        ``builder``, unchanged.

    Raises:
        TypeError, ValueError: see :func:`cembed.config.register_loss_config`.
    """
    register_loss_config(config_cls)
    (name,) = get_args(config_cls.model_fields["name"].annotation)
    LOSS_BUILDERS[name] = builder
    return builder


def _mnrl_kwargs(cfg: LossConfig, settings: LossSettings) -> dict:
    return dict(
        scale=cfg.scale,
        gather_across_devices=settings.gather_across_devices,
        directions=loss_directions(cfg.symmetric),
    )


def _build_cached_mnrl(model, cfg: CachedMNRLLossConfig, settings: LossSettings) -> nn.Module:
    return LengthSortedCachedMNRL(
        model,
        mini_batch_size=settings.mini_batch_size,
        mini_batch_num_tokens=settings.mini_batch_num_tokens,
        sort_by_length=settings.sort_by_length,
        unpad=settings.unpad,
        **_mnrl_kwargs(cfg, settings),
    )


def _build_mnrl(model, cfg: MNRLLossConfig, settings: LossSettings) -> nn.Module:
    return CountingMNRL(model, **_mnrl_kwargs(cfg, settings))


register_loss(CachedMNRLLossConfig, _build_cached_mnrl)
register_loss(MNRLLossConfig, _build_mnrl)


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
            (:func:`cembed.unpad.resolve_unpad`).

    Returns:
        A :class:`BuiltLoss`: the module for ``SentenceTransformerTrainer``, its token counter and
        whether it caches gradients.

    Raises:
        ValueError: no builder is registered for ``loss_cfg.name``.
        TypeError: the module's ``uses_gradient_cache`` contradicts the config class's.
        ModelRefused: ``unpad`` is True and the model cannot run packed rows.
    """
    builder = LOSS_BUILDERS.get(loss_cfg.name)
    if builder is None:
        raise ValueError(f"no builder registered for loss {loss_cfg.name!r}; known: {', '.join(LOSS_BUILDERS)}")
    settings = LossSettings(mini_batch_size, gather_across_devices, mini_batch_num_tokens, sort_by_length, unpad)
    module = builder(model, loss_cfg, settings)
    cached = bool(uses_gradient_cache(module))
    if cached != type(loss_cfg).uses_gradient_cache:
        raise TypeError(
            f"loss {loss_cfg.name!r}: the built {type(module).__name__} has uses_gradient_cache={cached}, but "
            f"{type(loss_cfg).__name__}.uses_gradient_cache is {type(loss_cfg).uses_gradient_cache}"
        )
    token_counts = getattr(module, "token_counts", None)
    if not isinstance(token_counts, TokenCounts):
        token_counts = TokenCounts()
    unpadding = getattr(module, "unpadding", None)
    if not isinstance(unpadding, Unpadding):
        return BuiltLoss(module, token_counts, cached)
    return BuiltLoss(module, token_counts, cached, unpadding)
