"""The batching rules a run may draw its batches by (``sampler.rule``), by name.

A rule is one :func:`register_batching_rule` call: its name, the factory of the trainer's
``batch_sampler`` and what the rest of cembed may know of its batches. The built-in rule is
``no_duplicates`` (:class:`cembed.data.batching.full_table.NoDuplicatesSampler`: a text never twice
in a batch; ``sampler.no_duplicates: false`` turns it into plain shuffled batches); a stream is always
batched by the windowed rule (:mod:`cembed.data.batching.windowed`), whatever the rule. A plugin
(:mod:`cembed.plugins`) may register more. The trainer's arguments (:func:`cembed.train.args.build_training_args`)
and the run summary (:mod:`cembed.train.summary`) go through here, never through a sampler class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from cembed.config.base import registered_by
from cembed.config.schema import SamplerConfig
from cembed.data.batching.full_table import NoDuplicatesSampler
from cembed.data.batching.mixture import SourceMix
from cembed.errors import UserError

SamplerFactory = Callable[[SamplerConfig, "SourceMix | None"], Any]


@dataclass(frozen=True)
class BatchingRule:
    """How one rule's batches are drawn, and what cembed may know of them ahead and after.

    Attributes:
        sampler: ``(the config's sampler section, the sources' mix or None for one source) -> the
            trainer's batch_sampler``: a sentence-transformers ``DefaultBatchSampler`` subclass (or a
            ``functools.partial`` of one), which the trainer builds with ``(dataset, batch_size,
            drop_last, valid_label_columns, generator, seed)``, or a ``BatchSamplers`` value.
        counted: the sampler class whose instances count their own batches: ``epoch``,
            ``batch_sources()``, ``rows_trained(steps, accumulation)``, ``trained_per_source(steps,
            accumulation)`` (the run summary's batches per source and rows trained); None: the summary
            counts ``steps x samples per step`` and reports no batches per source.
        placement: :mod:`cembed.data.batching.placement` predicts its batches when texts are compared
            (``validate``'s batch check, the unplaceable-row warnings, a column with fewer distinct
            texts than the batch): only the no-duplicates rule's.
    """

    sampler: SamplerFactory
    counted: type | None = None
    placement: bool = False


# name -> its rule; filled by register_batching_rule.
RULES: dict[str, BatchingRule] = {}


def register_batching_rule(
    name: str, sampler: SamplerFactory, counted: type | None = None, placement: bool = False
) -> None:
    """Register the batching rule ``name`` (``sampler.rule: <name>``); see :class:`BatchingRule`.
    Registering the same rule again is a no-op.

    Raises:
        ValueError: ``name`` is already registered to another rule.
    """
    entry = BatchingRule(sampler, counted, placement)
    if RULES.get(name, entry) != entry:
        raise ValueError(f"batching rule {name!r} is already registered ({registered_by(RULES[name].sampler)})")
    RULES[name] = entry


def batching_rule(settings: SamplerConfig) -> BatchingRule:
    """The rule ``settings.rule`` names.

    Raises:
        UserError: an unknown rule, naming ``sampler.rule`` and the known ones.
    """
    rule = RULES.get(settings.rule)
    if rule is None:
        known = ", ".join(RULES)
        raise UserError(f"sampler.rule: unknown batching rule {settings.rule!r}; known: {known}")
    return rule


def batch_sampler(settings: SamplerConfig, sources: SourceMix | None = None):
    """The trainer's ``batch_sampler`` argument for ``settings`` (the config's ``sampler`` section) and
    ``sources`` (several training sources; None: one).

    Raises:
        UserError: see :func:`batching_rule`, or the rule's own refusal.
    """
    return batching_rule(settings).sampler(settings, sources)


def predicted_by_placement(settings: SamplerConfig) -> bool:
    """Whether the run compares texts by the rule :mod:`cembed.data.batching.placement` predicts (the
    no-duplicates rule with ``no_duplicates`` on): then ``validate`` checks its batches ahead and
    warns of rows no batch can take.

    Raises:
        UserError: see :func:`batching_rule`.
    """
    return batching_rule(settings).placement and settings.no_duplicates


def counted_batches(sampler):
    """``sampler`` (the trainer's batch sampler, unwrapped from accelerate's shard wrapper) when its
    rule counts its own batches (:attr:`BatchingRule.counted`), else None."""
    sampler = getattr(sampler, "batch_sampler", sampler)  # accelerate's shard wrapper
    counted = tuple(r.counted for r in RULES.values() if r.counted is not None)
    return sampler if counted and isinstance(sampler, counted) else None


def _no_duplicates(settings: SamplerConfig, sources: SourceMix | None):
    """The full-table sampler; several sources: every batch from one source, laid out by the mix
    (``no_duplicates: false``: shuffled batches, still one source each); one source with
    ``no_duplicates: false``: sentence-transformers' plain batch sampler."""
    from sentence_transformers.base.sampler import BatchSamplers

    if sources is not None and len(sources.names) > 1:
        return partial(NoDuplicatesSampler, sources=sources, no_duplicates=settings.no_duplicates)
    return NoDuplicatesSampler if settings.no_duplicates else BatchSamplers.BATCH_SAMPLER


register_batching_rule("no_duplicates", _no_duplicates, counted=NoDuplicatesSampler, placement=True)
