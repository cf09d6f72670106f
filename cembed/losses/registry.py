"""The seam a new loss plugs into: :func:`register_loss`, :func:`build_loss` and :class:`BuiltLoss`.

The contract. A loss is three things, and nothing else in cembed names it:

* a config class, a subclass of :class:`cembed.config.loss.LossConfig` with
  ``name: Literal["<name>"] = "<name>"``, its own fields, and the class-level capability
  ``uses_gradient_cache`` (True when it embeds in mini-batches of ``mini_batch_size`` rows);
* a builder ``builder(model, cfg, settings: LossSettings) -> nn.Module``: ``cfg`` is the validated
  config instance, ``settings`` the run's mini-batching and gathering (:class:`LossSettings`). The
  module is called by the sentence-transformers trainer as ``module(features, labels)``, where
  ``features`` holds one dict per input column (anchor, positive, negatives...) with
  ``input_ids`` / ``attention_mask`` of shape ``(rows, seq_len)``, and it returns a scalar loss.
  The model turns a feature dict into ``sentence_embedding`` of shape ``(rows, dim)``. A module
  should carry ``token_counts`` (:class:`~cembed.losses.counts.TokenCounts`) for the throughput
  meter. A module whose ``uses_gradient_cache`` is True must be a sentence-transformers
  ``CachedLossMixin`` loss (``embed_minibatch_iter``, ``calculate_loss``): the probe measures its memory
  with them, reaching it as :attr:`BuiltLoss.cached_module`;
* one :func:`register_loss` call, in the loss's own module. :func:`build_loss` then returns a
  :class:`BuiltLoss`, which is all the trainer, the meter and the probe read.

The built-in losses register from their own modules, which ``cembed/losses/__init__.py`` imports:
:mod:`cembed.losses.mnrl` (``cached_mnrl``, ``mnrl``) and :mod:`cembed.losses.gist` (``cached_gist``).
``loss.matryoshka`` wraps any of them in :class:`cembed.losses.matryoshka.CountingMatryoshkaLoss`
(applied here, by :func:`build_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, get_args

from sentence_transformers.base.losses.gradcache import uses_gradient_cache
from torch import nn

from cembed.config.loss import LossConfig, register_loss_config
from cembed.losses.counts import FilterCounts, TokenCounts
from cembed.losses.matryoshka import CountingMatryoshkaLoss
from cembed.model.unpad import Unpadding, UnpadSetting


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

    def cached_kwargs(self) -> dict:
        """The constructor keywords a cached loss built on
        :class:`~cembed.losses.length_sorted.LengthSortedMixin` takes from these settings
        (``mini_batch_size``, ``mini_batch_num_tokens``, ``sort_by_length``, ``unpad``,
        ``gather_across_devices``)."""
        return dict(
            mini_batch_size=self.mini_batch_size,
            mini_batch_num_tokens=self.mini_batch_num_tokens,
            sort_by_length=self.sort_by_length,
            unpad=self.unpad,
            gather_across_devices=self.gather_across_devices,
        )


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
        settings: the mini-batching and gathering the builder was given (None: built elsewhere).
        cached_module: for a cached loss, the ``CachedLossMixin`` module whose ``embed_minibatch_iter``
            and ``calculate_loss`` run the mini-batches: the builder's module, which a
            ``loss.matryoshka`` wrapper (``module``) holds inside; None for a plain loss.
        notes: lines the module writes for the run's log while it trains (e.g. the MaxSim scoring path
            it chose on the first batch): the builder's module's ``notes`` list itself, so the trainer
            sees each line as it is added; empty for a module without one.
    """

    module: nn.Module
    token_counts: TokenCounts
    cached: bool
    filter_counts: FilterCounts | None = None
    unpadding: Unpadding = Unpadding(False, "padded (the loss embeds whole columns)")
    settings: LossSettings | None = None
    cached_module: nn.Module | None = None
    notes: list[str] = field(default_factory=list)

    def collective_facts(self) -> dict[str, object]:
        """What of this loss decides the collectives a training step issues, for
        :func:`cembed.distributed.collectives.require_same_on_all_ranks`: the module's class, and (from
        :attr:`settings`) whether it gathers across ranks and, for a cached loss, its mini-batch
        size and token budget (None where they do not apply or are unknown)."""
        settings, cached = self.settings, self.cached
        return {
            "loss": type(self.module).__name__,
            "mini_batch_size": settings.mini_batch_size if settings and cached else None,
            "mini_batch_num_tokens": settings.mini_batch_num_tokens if settings and cached else None,
            "gather_across_devices": settings.gather_across_devices if settings else None,
        }


def register_loss(config_cls: type[LossConfig], builder: LossBuilder) -> LossBuilder:
    """Make ``loss.name: <name>`` usable: register ``config_cls`` (see
    :func:`cembed.config.loss.register_loss_config`) and its ``builder`` under the config's name.

    Returns:
        ``builder``, unchanged.

    Raises:
        TypeError, ValueError: see :func:`cembed.config.loss.register_loss_config`.
    """
    register_loss_config(config_cls)
    (name,) = get_args(config_cls.model_fields["name"].annotation)
    LOSS_BUILDERS[name] = builder
    return builder


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
    module = inner = builder(model, loss_cfg, settings)
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
    notes = getattr(inner, "notes", None)
    return BuiltLoss(
        module,
        token_counts,
        cached,
        filter_counts if isinstance(filter_counts, FilterCounts) else None,
        unpadding if isinstance(unpadding, Unpadding) else BuiltLoss.unpadding,
        settings,
        inner if cached else None,
        notes if isinstance(notes, list) else [],
    )
