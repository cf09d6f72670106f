"""A run's facts, computed once from the checked inputs: batches per epoch, optimizer steps and
warmup, the rows the no-duplicates sampler cannot place, and the path the loss takes.

:func:`run_facts` is called after :func:`cembed.train.recipe.check_run_inputs` by every command that
describes or starts a run: ``cembed validate`` (its summary and ``--json``), ``cembed estimate``
(steps, the mini-batch path it counts tokens on, the FLOP passes), ``cembed train`` and each
``cembed sweep`` trial (the unplaceable-row warnings printed and recorded with the run). Nothing
here prints.

The counts are the rows' arithmetic: a source of ``r`` rows gives ``r / global batch`` batches (a
short last batch counted unless ``drop_last``), the sources' batches are laid out by the
``data.sampling`` schedule (:meth:`cembed.data.batching.mixture.SourceMix.schedule`), an epoch is
``ceil(batches / gradient_accumulation_steps)`` optimizer steps (at least 1), the run is
``train.max_steps`` or ``ceil(epochs x steps per epoch)`` steps, ``ceil(total x
optim.warmup_ratio)`` of them warmup. The no-duplicates sampler can build fewer batches than the
rows allow, and a ``round_robin`` / ``weighted`` schedule ends an epoch when one source runs out; the
warnings say how many rows each leaves out (the latter from the sampler's own epoch plan,
:func:`cembed.data.batching.placement.schedule_warnings`). A stream's rows and an unloaded hub
dataset's are not known ahead: their counts are None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cembed.config.schema import CembedConfig
from cembed.data.batching.mixture import SourceMix
from cembed.data.batching.placement import (
    check_sampler_batches,
    sampler_hashes,
    schedule_warnings,
    unplaceable_warnings,
)
from cembed.data.batching.rules import batching_rule, predicted_by_placement
from cembed.plan.resolve import Plan
from cembed.train.flops import forward_passes


@dataclass(frozen=True)
class StepFacts:
    """How long the run is, in optimizer steps."""

    total: int | None  # train.max_steps, else ceil(epochs x per_epoch); None: rows unknown
    total_from: str  # "train.max_steps" or "train.num_train_epochs: <epochs>"
    per_epoch: int | None  # ceil(batches per epoch / accumulation), at least 1; None: rows unknown
    warmup: int | None  # ceil(total x optim.warmup_ratio); None with total


@dataclass(frozen=True)
class LossPath:
    """How the loss embeds a step's rows: the path ``cembed estimate`` counts tokens and FLOPs on."""

    cached: bool  # the loss uses_gradient_cache: it embeds in mini-batches (no-grad pass, then grad pass)
    mini_batch_size: int  # rows per forward: a cached loss's plan.mini_batch_size, else (or auto) the per-device batch
    sort_by_length: bool  # a cached loss with batch.sort_by_length: each column sorted before it is cut
    packed: bool | None  # a cached loss on a model that packs rows (batch.unpad); None: the model was not given
    passes: int  # forward-pass equivalents per row in the FLOP count: 4 cached, 3 plain

    @property
    def description(self) -> str:
        """The path in a few words (``packed (unpadded) mini-batches``, ``sorted=True, padded per
        mini-batch of 64``)."""
        if self.packed:
            return "packed (unpadded) mini-batches"
        return f"sorted={self.sort_by_length}, padded per mini-batch of {self.mini_batch_size}"


@dataclass(frozen=True)
class RunFacts:
    """What a run will do, before it starts (see the module docstring for the arithmetic)."""

    global_batch: int  # rows per global batch: per device x world size
    drop_last: bool  # batch.drop_last, always on with more than one process
    source_batches: tuple[int | None, ...]  # batches per epoch of each training source, config order (); None: a stream
    batches_per_epoch: (
        int | None
    )  # all sources' batches as the data.sampling schedule lays them out; None: rows unknown
    steps: StepFacts
    loss: LossPath
    warnings: tuple[str, ...] = ()  # rows the no-duplicates sampler cannot place, one line per source


def batch_count(rows: int, batch: int, drop_last: bool) -> int:
    """Batches of ``batch`` rows in ``rows``: a short last batch counts unless ``drop_last``."""
    return rows // batch if drop_last else -(-rows // batch)


def step_facts(cfg: CembedConfig, plan: Plan, batches: int | None) -> StepFacts:
    """The run's length from ``batches`` global batches per epoch (None: unknown) under ``cfg.train``
    and the plan's gradient accumulation."""
    per_epoch = max(1, -(-batches // plan.gradient_accumulation_steps)) if batches else None
    if cfg.train.max_steps:
        total, length = cfg.train.max_steps, "train.max_steps"
    else:
        epochs = cfg.train.num_train_epochs
        total = math.ceil(epochs * per_epoch) if per_epoch else None
        length = f"train.num_train_epochs: {epochs:g}"
    warmup = math.ceil(total * cfg.optim.warmup_ratio) if total is not None else None
    return StepFacts(total, length, per_epoch, warmup)


def loss_path(cfg: CembedConfig, plan: Plan, model=None, attention=None) -> LossPath:
    """The path ``cfg.loss`` takes under ``plan``. Whether a cached loss packs rows needs the model:
    ``attention``, its :class:`cembed.model.unpad.Unpadding` when the caller resolved it already, else
    :func:`cembed.model.unpad.resolve_unpad` on the loaded ``model`` and ``batch.unpad``; neither: unknown.

    Raises:
        ModelRefused: ``batch.unpad: true`` on a model that cannot pack (a cached loss, ``model`` given).
    """
    cached = cfg.loss.uses_gradient_cache
    mini = plan.mini_batch_size if cached and plan.mini_batch_size else plan.per_device_train_batch_size
    packed: bool | None = False
    if cached and attention is not None:
        packed = attention.enabled
    elif cached and model is not None:
        from cembed.model.unpad import resolve_unpad

        packed = resolve_unpad(model, cfg.batch.unpad).enabled
    elif cached:
        packed = None
    return LossPath(cached, mini, cached and cfg.batch.sort_by_length, packed, forward_passes(cached))


def run_facts(cfg: CembedConfig, plan: Plan, data, model=None, placement: bool = True, attention=None) -> RunFacts:
    """The facts of ``cfg``'s run under ``plan`` on ``data`` (what :func:`cembed.train.recipe.check_run_inputs`
    returned: a ``TrainingData``, or ``UnloadedData`` for a hub dataset ``validate`` could not reach).

    Args:
        model: the loaded model (a SentenceTransformer), or None. Given, the sampler's rows are
            compared as training compares them (:func:`cembed.data.batching.placement.sampler_hashes`: token ids
            when training pre-tokenizes) and a source it cannot fill one batch from is refused, as
            ``train`` refuses it; the loss path then says whether it packs rows. None: raw texts
            compared (the start of ``train``, a sweep trial), packing unknown.
        placement: run the sampler's first epoch for the rows it cannot place (no-duplicates
            sampler, counted data); False skips it (``estimate`` counts rows / batch only) and
            leaves ``warnings`` empty.
        attention: ``model``'s resolved :class:`cembed.model.unpad.Unpadding`, when the caller has it
            (``validate``'s truncation report), so that it is not resolved again (see :func:`loss_path`).

    Raises:
        UserError: with ``model``, no duplicate-free batch can be built from a source
            (:func:`cembed.data.batching.placement.check_sampler_batches`).
        ModelRefused: see :func:`loss_path`.
    """
    batch = plan.per_device_train_batch_size * plan.world_size
    drop = cfg.batch.drop_last or plan.world_size > 1
    loaded = hasattr(data, "dataset")
    streamed = loaded and data.streamed is not None
    sources: tuple[int | None, ...] = ()
    batches = None
    if streamed:  # only the stream's first rows were read: nothing is counted
        sources = (None,) * len(data.sources)
    elif loaded:
        sources = tuple(batch_count(s.rows, batch, drop) for s in data.sources)
        per_source = list(sources) or [batch_count(len(data.dataset), batch, drop)]
        batches = len(SourceMix.from_data(data, cfg.data.sampling).schedule(per_source))
    warnings: tuple[str, ...] = ()
    hashes = None  # raw text, unless the model says how training compares texts
    # only a rule placement predicts (the no-duplicates one) leaves rows unplaced; a plain sampler places every row
    if placement and predicted_by_placement(cfg.sampler) and loaded and not streamed:
        if model is not None:
            hashes, compared = sampler_hashes(data, cfg.model, cfg.data, model=model)
            check_sampler_batches(plan, data, cfg.batch.drop_last, cfg.train.seed, hashes, compared)
        warnings = unplaceable_warnings(plan, data, cfg.batch.drop_last, cfg.train.seed, hashes)
    # the rule that lays several sources out by data.sampling (no_duplicates on or off): rows its
    # schedule leaves unused, from the sampler's own epoch plan
    if placement and batching_rule(cfg.sampler).placement and loaded and not streamed:
        if not cfg.sampler.no_duplicates:
            hashes = np.empty((len(data.dataset), 0), dtype=np.uint64)  # texts not compared
        warnings += schedule_warnings(plan, data, cfg.data.sampling, cfg.batch.drop_last, cfg.train.seed, hashes)
    return RunFacts(
        batch, drop, sources, batches, step_facts(cfg, plan, batches), loss_path(cfg, plan, model, attention), warnings
    )
