"""``cembed train`` as a recipe: named stages, each a function of the previous stage's output.

    check_run_inputs   config -> (Plan, TrainingData)              (also all that ``validate`` checks)
    run_facts          (Plan, TrainingData) -> RunFacts: batches, steps, warmup, unplaceable rows, loss path
                       (:mod:`cembed.train.facts`; the caller hands its warnings to run_training)
    prepare_output     output folder, resume point, run log        -> RunDir
    resolve_runtime    process group, device, mini_batch_size: auto -> the final Plan
    build_components   model, tokenized data, collator, loss, evaluation -> Components
    build_trainer      CembedTrainer + callbacks                   -> Run
    train              trainer.train(), failure / interruption recorded in run_summary.json
    write_summary      model, run_summary.json, plot

A stop signal is handled from the first step to the summary: before the last step it stops the run
after a checkpoint, during or after it the run is finished within ``train.stop_grace_seconds`` or
stopped where ``--resume`` finishes it (:mod:`cembed.train.stopping`); a second one abandons the run
(:class:`~cembed.errors.RunAbandoned`, recorded in ``run_summary.json`` and ``train.log``).

Nothing here reads the YAML again: the config's sections and the resolved :class:`~cembed.plan.resolve.Plan`
are passed down. Nothing here prints either: what a run shows goes to the :class:`RunDisplay` it is
handed (``cembed train``: :class:`cembed.cli.display.run.RichRunDisplay`; by default :class:`QuietRunDisplay`).
In a multi-process job every rank runs the recipe; only rank 0 prints, saves the model and writes
the summary.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from cembed.config.schema import CembedConfig
from cembed.data.batchable import load_checked_data
from cembed.data.batching.mixture import SourceMix
from cembed.data.batching.rules import predicted_by_placement
from cembed.data.prompts import prompt_room_error, training_prompts
from cembed.data.rows import TrainingData, UnloadedData, card_datasets
from cembed.data.tokens.tokenize import tokenize_stage
from cembed.distributed.collectives import max_over_ranks
from cembed.distributed.ddp import freeze_parameters, ignore_in_ddp, unused_parameters
from cembed.distributed.fsdp import gathered_model, shard_layer_classes
from cembed.distributed.group import backend_for, dist_info, init_distributed, local_main_first
from cembed.distributed.launch import job_restart_count
from cembed.errors import RunAbandoned, RunFailed, RunInterrupted, UserError
from cembed.files import append_log, display_path, save_model_atomic, write_json_atomic
from cembed.losses.registry import build_loss
from cembed.model.kinds.lookup import kind_of
from cembed.model.load import cast_for_saving, load_model, quiet_libraries, weight_dtypes
from cembed.model.lora import adapter_facts, finish_lora, is_lora
from cembed.model.prompts import RolePrompts, set_trained_prompts
from cembed.plan.precision import enable_tf32
from cembed.plan.resolve import Plan, resolve_plan
from cembed.probe.auto import resolve_auto
from cembed.probe.search import ProbeResult
from cembed.train.args import build_training_args
from cembed.train.checkpoint import (
    InterruptCallback,
    TimedSaveCallback,
    check_output_dir,
    check_resume_point,
    checkpoint_progress,
    later_checkpoints,
    latest_complete,
    recorded_run,
    remove_checkpoints,
    remove_incomplete,
    resolve_resume,
    resume_on_restart,
    run_status,
)
from cembed.train.flops import build_flop_model
from cembed.train.kinds import column_tasks, router_mapping, trainer_for_kind
from cembed.train.meter import ThroughputMeter, plot_run
from cembed.train.preflight import check_resume, freezes_unused, preflight, raise_findings, training_record
from cembed.train.publish import (
    add_card_facts,
    describe_base_model,
    describe_training_data,
    forget_eval_results,
    mark_eval_before,
    push_final_model,
    record_final_eval,
    write_model_card,
)
from cembed.train.stopping import EVALUATION, FINAL_SAVE, RunEnd, end_estimate
from cembed.train.summary import Attempt, failed_summary, failures_recorded, samples_seen, source_summary, summary_base
from cembed.train.trainer import CembedTrainer, RunLog, RunLogCallback

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from cembed.model.unpad import Unpadding


class RunDisplay(Protocol):
    """What a training run shows, in the order the recipe calls it. The recipe computes every value
    and never prints; a display decides how (or whether) to show it. Only rank 0's display is asked
    for the components and the evaluation lines; every rank's for the rest (the CLI hands other ranks
    a quiet one)."""

    def probe_start(self, device: str) -> None:
        """``batch.mini_batch_size: auto`` is about to be probed on ``device``."""

    def probe(self, result: ProbeResult) -> None:
        """The probe's result (:class:`cembed.probe.search.ProbeResult`), once it is measured."""

    def run_header(self, cfg: CembedConfig, plan: Plan, warnings: tuple[str, ...]) -> None:
        """The final plan (device, precision, batch, mini-batch, loss, LR, its warnings) before the model
        loads, and ``warnings``: the run's findings (the data's, unplaceable rows, resume changes)."""

    def components(self, unpadding: Unpadding, distributed: dict | None, warnings: tuple[str, ...] = ()) -> None:
        """The attention path the loss runs and, for several processes, ``run_summary['distributed']``;
        ``warnings``: what building them found (pre-tokenizing fell back to tokenizing in the collator)."""

    def progress(self, log: RunLog, samples_per_step: int) -> TrainerCallback | None:
        """A trainer callback that shows progress from ``log`` (the run's :class:`RunLog`), or None."""

    def log_line(self, line: str) -> None:
        """One logging interval's line (step, loss, LR, samples/s; also written to ``train.log``)."""

    def eval_line(self, line: str) -> None:
        """One evaluation's headline metrics (``eval before training: ...``, ``eval step N: ...``)."""

    def resuming(self, checkpoint: str, step: int, max_steps: int) -> None:
        """The run continues ``checkpoint``, saved at optimizer step ``step`` of ``max_steps``."""

    def interrupt(self, signal_name: str, step: int | None, grace_s: float | None = None) -> None:
        """``signal_name`` (``SIGINT``, ``SIGTERM``, ``SIGUSR1``, ``SIGHUP``) arrived: optimizer step ``step`` is being finished,
        then a checkpoint is saved and the run stops; a second one abandons the step. Called at
        once, from a thread of its own, while the step goes on. ``grace_s`` (the last step, or
        ``step`` None: after it): the run is finished instead if that fits in ``grace_s`` seconds
        (``train.stop_grace_seconds``), else stopped where ``--resume`` finishes it."""

    def tokenize_progress(self) -> AbstractContextManager[Callable[[int, int], None] | None]:
        """A context around pre-tokenization that yields ``progress(rows_done, rows_total)`` (called
        from another thread about twice a second, and not at all when the cache is loaded) or None."""


class QuietRunDisplay:
    """A :class:`RunDisplay` that shows nothing: the default of :func:`run_training` (scripts, tests)."""

    def probe_start(self, device: str) -> None:
        pass

    def probe(self, result: ProbeResult) -> None:
        pass

    def run_header(self, cfg: CembedConfig, plan: Plan, warnings: tuple[str, ...]) -> None:
        pass

    def components(self, unpadding: Unpadding, distributed: dict | None, warnings: tuple[str, ...] = ()) -> None:
        pass

    def progress(self, log: RunLog, samples_per_step: int) -> TrainerCallback | None:
        return None

    def log_line(self, line: str) -> None:
        pass

    def eval_line(self, line: str) -> None:
        pass

    def resuming(self, checkpoint: str, step: int, max_steps: int) -> None:
        pass

    def interrupt(self, signal_name: str, step: int | None, grace_s: float | None = None) -> None:
        pass

    def tokenize_progress(self) -> AbstractContextManager[Callable[[int, int], None] | None]:
        return nullcontext()


def check_run_config(cfg: CembedConfig, world_size: int | None = None) -> Plan:
    """Resolve the plan and run the pre-flight checks (:mod:`cembed.train.preflight`): what
    :func:`check_run_inputs` checks without loading the data (the launcher of a multi-process run
    checks this much; each worker checks the data itself).

    Raises:
        UserError: a config or pre-flight mistake, one line naming the field and the fix.
    """
    plan = resolve_plan(cfg, world_size)
    raise_findings(preflight(cfg, plan.learning_rate))
    return plan


def check_run_inputs(
    cfg: CembedConfig, world_size: int | None = None, allow_unloaded: bool = False
) -> tuple[Plan, TrainingData | UnloadedData]:
    """Resolve the plan, run the pre-flight checks (model limits, scheduler, tokenizer; see
    :mod:`cembed.train.preflight`) and load/check the training data (everything ``validate`` checks); with
    ``allow_unloaded`` (validate) a hub dataset the hub cannot serve gives UnloadedData, not an error.
    The data's own warnings (unmapped / expanded columns) stay on the data (``TrainingData.warnings``),
    beside the plan's.

    Raises:
        UserError: a config, data or pre-flight mistake, one line naming the field and the fix.
    """
    plan = check_run_config(cfg, world_size)
    batch = plan.per_device_train_batch_size * plan.world_size
    # The distinct-text check holds for the rule placement predicts (the no-duplicates one, texts compared).
    data = load_checked_data(cfg.data, batch, predicted_by_placement(cfg.sampler), allow_unloaded)
    if cfg.eval is not None:  # load the eval sets once here so `validate` reports their mistakes
        from cembed.eval.sets import load_eval_sets
        from cembed.train.evaluation import check_metric_name, training_eval_args

        similarity = type(cfg.model).similarity
        metric = check_metric_name(cfg.eval.metric_for_best_model, load_eval_sets(cfg.eval), similarity)
        training_eval_args(cfg.eval, metric, cfg.train.save_steps)
    return plan, data


@dataclass
class RunDir:
    """Where a run writes, the checkpoint it resumes from (None: a fresh run), what the run is
    (``preflight.training_record``, stored in its checkpoints) and the safe changes a resume applies."""

    out: Path
    checkpoint: str | None
    record: dict | None = None
    resume_changes: tuple[str, ...] = ()
    restarts: int = 0  # the job's restarts so far (cembed.distributed.launch.job_restart_count)

    @property
    def log_path(self) -> Path:
        return self.out / "train.log"

    @property
    def summary_path(self) -> Path:
        return self.out / "run_summary.json"


def prepare_output(
    output_dir: str,
    max_steps: int | None,
    plan: Plan,
    resume: bool,
    resume_from: str | None,
    overwrite: bool,
    record: dict | None = None,
) -> RunDir:
    """Check ``output_dir`` and find the resume point; on rank 0 create the folder, remove
    half-written checkpoints of a killed run and start the run's log.

    Args:
        record: this run's ``preflight.training_record``, compared with the checkpoint's on resume.

    Raises:
        UserError: the folder holds a finished model (without ``overwrite``), there is no checkpoint
            to resume, the checkpoint cannot be resumed under ``max_steps``, or the config changes
            what the checkpoint's run trains (naming each change).
    """
    out = Path(output_dir)
    # Resuming a checkpoint of another folder into a finished output_dir still needs --overwrite.
    continuing = resume or bool(resume_from and Path(resume_from).resolve().parent == out.resolve())
    check_output_dir(out, overwrite, continuing)
    checkpoint = resolve_resume(out, resume, resume_from)
    changes: list[str] = []
    later: list[Path] = []
    if checkpoint:
        check_resume_point(checkpoint, max_steps, finished=run_status(Path(checkpoint).parent) == "completed")
        changes = check_resume(checkpoint, recorded_run(checkpoint), record) if record else []
        later = later_checkpoints(out, checkpoint)
        if later and not overwrite:
            # Left beside this run's, a later --resume would take the newest of either continuation.
            raise UserError(
                f"--resume-from {display_path(checkpoint)}: train.output_dir also holds the later "
                f"{', '.join(p.name for p in later)} of the run this one replaces from step "
                f"{checkpoint_progress(checkpoint)[0]}; add --overwrite to remove them, or resume into another output_dir"
            )
    run = RunDir(out, checkpoint, record, tuple(changes))
    if dist_info().is_main:
        out.mkdir(parents=True, exist_ok=True)
        remove_incomplete(out)  # a half-written checkpoint from a killed run is never used
        if overwrite and not checkpoint:  # a fresh run replaces the folder's run, checkpoints included
            remove_checkpoints(out)
        for replaced in later:  # --resume-from an earlier checkpoint with --overwrite: its later ones go
            shutil.rmtree(replaced, ignore_errors=True)
        if run_status(out) == "completed":  # this run replaces a finished one (--overwrite, --resume-from): a
            # later --resume must not take that run's summary for this one's end (checkpoint.completed_run)
            run.summary_path.unlink(missing_ok=True)
        start = (
            f"resume from {checkpoint}"
            + (f" with {'; '.join(changes)}" if changes else "")
            + (f"; removed the later {', '.join(p.name for p in later)}" if later else "")
            if checkpoint
            else "fresh run"
        )
        append_log(run.log_path, f"start: {start}; lr {plan.lr_derivation}")
    return run


def resolve_runtime(cfg: CembedConfig, plan: Plan, data: TrainingData, display: RunDisplay, max_memory: str | None):
    """Join the process group and pick this rank's device, then probe ``mini_batch_size: auto``
    there (after the group exists, so every rank agrees on the minimum); ``display`` shows the probe.

    Returns ``(device, plan with mini_batch_size set)``; device is ``cpu``, ``cuda`` or ``cuda:<local rank>``.
    """
    device = init_distributed(plan.device, cfg.distributed.timeout_minutes)
    if plan.tf32:  # fp32 matmuls (the loss stage too) on TF32 tensor cores, the probe included
        enable_tf32()
    if plan.mini_batch_size is None:
        display.probe_start(plan.device)
    plan, probe = resolve_auto(
        plan, cfg.model, cfg.loss, len(data.columns), max_memory, strategy=cfg.distributed.strategy
    )
    if probe is not None:
        display.probe(probe)
    return device, plan


@dataclass
class Components:
    """Everything the trainer is built from."""

    model: Any  # SentenceTransformer
    train_dataset: Any  # datasets.Dataset (pre-tokenized, or the texts)
    collator: Any  # PaddingCollator, or None for sentence-transformers' own
    loss: Any  # the built loss (module and token counts)
    evaluation: Any  # cembed.train.evaluation.TrainingEvaluation, or None
    token_info: dict
    distributed: dict | None  # what run_summary.json records about the process group
    source: str  # the training data's label, for messages
    weights: Any = None  # cembed.model.load.WeightDtypes: stored, training, autocast and saved dtypes
    prompts: RolePrompts = field(default_factory=RolePrompts)  # each role's prompt
    sources: SourceMix | None = None  # the training sources and how batches are drawn from them
    source_prompts: list[RolePrompts] | None = None  # per source, when a source sets prompts of its own
    card_dataset: Any = None  # what the model card describes (sources with different columns), else None
    # What every rank must share about the data (a prepared source's fingerprint).
    data_facts: dict = field(default_factory=dict)


def build_components(
    cfg: CembedConfig,
    plan: Plan,
    data: TrainingData,
    device: str,
    on_line=None,
    tokenize_progress=None,
    freeze_unused: bool | None = None,
) -> Components:
    """Load the model on ``device``, tokenize the data, build the loss and the evaluation.

    Args:
        freeze_unused: freeze the parameters that get no gradient (:func:`cembed.train.preflight.freezes_unused`;
            None: on several processes).
        on_line: receives the evaluation's printed lines (None: silent).
        tokenize_progress: :meth:`RunDisplay.tokenize_progress` (None: no progress shown).

    Raises:
        UserError: the model cannot be loaded, or an eval set is wrong.
    """
    model = load_model(cfg.model, device, seed=cfg.train.seed)
    describe_base_model(model, cfg.model.name_or_path, cfg.model.revision)  # the card's, before the trainer fills it
    resolved = training_prompts(data, model, cfg.data.prompts)
    room = prompt_room_error(data, model, resolved)
    if room is not None:  # before the sampler's refusal it causes (every text the prompt alone)
        raise UserError(room)
    prompts, per_source, column_prompts, by_source = resolved
    set_trained_prompts(model, prompts)  # every save (checkpoints, the final model) carries them
    shown = tokenize_progress() if tokenize_progress is not None else nullcontext()
    # One process per node fills the tokenization cache, the others load it.
    with local_main_first(), shown as progress:
        train_dataset, collator, token_info = tokenize_stage(
            model,
            data,
            cfg.data.pretokenize and data.streamed is None,  # a stream is tokenized on the fly (below)
            cfg.data.cache_dir,
            column_prompts,
            cfg.batch.pad_to_multiple_of,
            by_source,
            cfg.data.num_proc,
            progress,
        )
    if data.streamed is not None:  # data.train.streaming: this rank's windowed batches, read as trained
        train_dataset, collator, token_info = _stream_rows(cfg, plan, data, model, prompts)
    token_info["prompts"] = prompts.to_dict()
    if per_source is not None:
        token_info["source_prompts"] = {s.name: p.to_dict() for s, p in zip(data.sources, per_source)}
    loss = build_loss(
        model,
        cfg.loss,
        plan.mini_batch_size,
        gather_across_devices=plan.gather_across_devices,
        mini_batch_num_tokens=plan.mini_batch_num_tokens,
        sort_by_length=cfg.batch.sort_by_length,
        unpad=False if cfg.train.torch_compile else cfg.batch.unpad,  # compiled graphs bypass packing
    )
    distributed = None
    freeze = plan.world_size > 1 if freeze_unused is None else freeze_unused
    # The sampler only yields whole global batches and these never get a gradient, so DDP needs no
    # unused-parameter search: they are frozen, or (a resume of a run begun on one process, whose
    # optimizer holds them) ignored by DDP (preflight.freezes_unused).
    outputs = kind_of(model, default="dense").text_outputs
    tasks = column_tasks(model, data.columns)  # each column down its own route (a Router's query side)
    check = freeze or plan.world_size > 1
    unused = unused_parameters(model, data.sample_texts(), tasks=tasks, outputs=outputs) if check else []
    if freeze:
        freeze_parameters(model, unused)
    elif plan.world_size > 1 and cfg.distributed.strategy == "ddp":
        ignore_in_ddp(model, unused)
    if plan.world_size > 1:
        distributed = {
            "world_size": plan.world_size,
            "strategy": cfg.distributed.strategy,  # fsdp: parameters, gradients, optimizer state sharded
            "backend": backend_for(plan.device),
            "gather_across_devices": plan.gather_across_devices,
            "frozen_unused_parameters": unused if freeze else [],
            "ddp_ignored_parameters": [] if freeze else unused,
            "find_unused_parameters": False,
        }
    evaluation = None
    if cfg.eval is not None:
        from cembed.train.evaluation import TrainingEvaluation

        evaluation = TrainingEvaluation.from_config(
            cfg.eval, cfg.train.save_steps, on_line=on_line, prompts=prompts, similarity=type(cfg.model).similarity
        )
    parts = (model, train_dataset, collator, loss, evaluation, token_info, distributed, data.source)
    mix = SourceMix.from_data(data, cfg.data.sampling)
    weights = weight_dtypes(model, cfg.model, plan.precision)
    facts = {"prepared": data.manifest.fingerprint} if data.manifest is not None else {}
    return Components(*parts, weights, prompts, mix, per_source, card_datasets(data), facts)


def _stream_rows(cfg: CembedConfig, plan: Plan, data: TrainingData, model, prompts: RolePrompts):
    """A streamed source's training rows and collator (:func:`cembed.data.batching.stream.training_stream`)
    for this rank: its per-device batch and the run's seed; pass after pass in one unbounded epoch
    (``train.max_steps`` ends it), so a resumed run's skipped batches land where the run was.

    Raises:
        UserError: the run would prompt the stream's texts, or the model takes more than token ids.
    """
    from cembed.data.batching.stream import check_stream_prompts, training_stream

    check_stream_prompts(prompts, data.columns, data.sources[0].key)
    info = dist_info()
    return training_stream(
        data,
        model,
        plan.per_device_train_batch_size,
        info.rank,
        plan.world_size,
        seed=cfg.train.seed,
        pad_to_multiple_of=cfg.batch.pad_to_multiple_of,
    )


@dataclass
class Run:
    """A trainer ready to train, with the callbacks the recipe reads afterwards."""

    trainer: CembedTrainer
    log: RunLog
    interrupt: InterruptCallback
    batches_per_epoch: int | None  # per rank = optimizer steps per epoch (None: a stream, not counted)
    rows_unplaced: int  # rows the no-duplicates sampler could not place in the first epoch
    build_model: Any = None  # device -> the run's model as first loaded (FSDP's final model is gathered into it)
    end: RunEnd | None = None  # the run's end after the last step, which a stop signal may cut short


def build_trainer(
    cfg: CembedConfig,
    plan: Plan,
    parts: Components,
    run_dir: RunDir,
    display: RunDisplay | None = None,
    trainer_cls: type[CembedTrainer] = CembedTrainer,
) -> Run:
    """Build ``trainer_cls`` with the meter, the non-finite-loss policy, the run log, the progress
    callback of ``display`` (default: none), signal handling and evaluation callbacks.

    Raises:
        UserError: a ``train.report_to`` tracker is missing, or the sampler cannot fill one batch.
    """
    from transformers.trainer_callback import PrinterCallback

    is_main = dist_info().is_main
    kind = kind_of(parts.model)
    layers = shard_layer_classes(kind.encoder_module(parts.model).auto_model)  # FSDP's units
    eval_args = parts.evaluation.training_args if parts.evaluation else None
    args = build_training_args(cfg, plan, eval_args, layers, parts.sources, kind.trainer_classes().training_args)
    trainer_cls = trainer_for_kind(trainer_cls, kind)  # the kind's model, arguments, collator and card classes
    if parts.collator is None:  # sentence-transformers' collator tokenizes, with the same prompts and routes
        args.prompts = parts.prompts.for_columns(parts.train_dataset.column_names) or None
        args.router_mapping = router_mapping(parts.model, parts.train_dataset.column_names) or args.router_mapping
        if parts.source_prompts is not None:  # its per-dataset form: source name -> column -> prompt
            names = list(parts.sources.names)
            args.prompts = {
                n: p.for_columns(parts.train_dataset.column_names) for n, p in zip(names, parts.source_prompts)
            }
    flops = build_flop_model(parts.model, parts.loss.cached, plan.precision, plan.device, cfg.train.peak_tflops)
    trainer = trainer_cls(
        model=parts.model,
        args=args,
        train_dataset=parts.train_dataset,
        loss=parts.loss.module,
        data_collator=parts.collator,
        evaluator=parts.evaluation.evaluator if parts.evaluation else None,
        meter=ThroughputMeter(
            parts.loss.token_counts,
            flops,
            filter_counts=parts.loss.filter_counts,
            sparse_counts=parts.loss.sparse_counts,
        ),
        callbacks=list(parts.loss.callbacks),
        nonfinite_policy=cfg.train.nonfinite_loss,
        built_loss=parts.loss,
        card_dataset=parts.card_dataset,
        data_facts=parts.data_facts,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.run_record = run_dir.record
    if parts.collator is None and parts.source_prompts is not None:  # rows name their source for its prompts
        trainer.source_rows = (list(parts.sources.names), list(parts.sources.sizes))
    log = RunLog()
    display = display if display is not None else QuietRunDisplay()
    progress = display.progress(log, plan.samples_per_step)
    log_path = run_dir.log_path if is_main else None
    trainer.add_callback(
        RunLogCallback(log, plan.samples_per_step, log_path, display.log_line, trainer.step_loss, parts.loss.notes)
    )
    if progress is not None:
        trainer.add_callback(progress)
    interrupt = InterruptCallback()
    grace = cfg.train.stop_grace_seconds
    end = RunEnd(interrupt, grace, run_dir.summary_path, run_dir.log_path, is_main)

    def on_signal(signum: int, step: int | None) -> None:
        last = step is None or bool(interrupt.max_steps and step >= interrupt.max_steps)
        display.interrupt(signal.Signals(signum).name, step, grace if last else None)
        end.signalled(signum, step)

    interrupt.on_signal = on_signal
    trainer.add_callback(interrupt)
    if cfg.train.save_every_minutes:
        trainer.add_callback(TimedSaveCallback(cfg.train.save_every_minutes))
    if parts.evaluation:
        trainer.add_callback(parts.evaluation.callback)
    build = lambda device: load_model(cfg.model, device, seed=cfg.train.seed)  # noqa: E731
    if trainer.streaming:  # a stream's batches are not counted ahead (train.max_steps bounds the run)
        return Run(trainer, log, interrupt, None, 0, build, end)
    sampler = trainer.get_train_dataloader().batch_sampler
    batches_per_epoch = len(sampler)  # per rank (accelerate's shard wrapper) = optimizer steps per epoch
    sampler = getattr(sampler, "batch_sampler", sampler)
    if batches_per_epoch == 0:
        raise UserError(
            f"{parts.source}: the no-duplicates sampler cannot fill a single batch of {plan.per_device_train_batch_size} "
            f"rows{_no_batch_columns(sampler, plan)}; {_smaller_batch(sampler, plan)}"
        )
    return Run(trainer, log, interrupt, batches_per_epoch, getattr(sampler, "unplaced", 0), build, end)


def _no_batch_columns(sampler, plan: Plan) -> str:
    """``": <why>"`` naming the column(s) that keep ``sampler`` (a NoDuplicatesSampler) from filling
    one batch (:func:`cembed.data.batching.placement.no_batch_reason` on its own hashes, first source), or ``""``."""
    from cembed.data.batching.placement import no_batch_reason

    hashes, columns = getattr(sampler, "hashes", None), getattr(sampler, "columns", None)
    if hashes is None or not columns:
        return ""
    n, batch = sampler.sources.sizes[0], plan.per_device_train_batch_size * plan.world_size
    return ": " + no_batch_reason(hashes[:n], [repr(c) for c in columns], batch, sampler.compared_as)


def _smaller_batch(sampler, plan: Plan) -> str:
    """The fix of a 0-batch refusal: the largest ``batch.per_device_train_batch_size`` that ``sampler``
    (a NoDuplicatesSampler) fills a batch with in epoch 0, on its own hashes and seed, every source
    (:func:`cembed.data.batching.placement.smaller_batch_fix`, the size ``validate`` names)."""
    from cembed.data.batching.full_table import SOURCE_SEED_STRIDE
    from cembed.data.batching.placement import largest_filled_batch, smaller_batch_fix

    hashes, sizes = getattr(sampler, "hashes", None), getattr(getattr(sampler, "sources", None), "sizes", None)
    if hashes is None or not sizes:
        return "lower batch.per_device_train_batch_size"
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    largest = min(
        largest_filled_batch(hashes[o : o + n], sampler.seed + i * SOURCE_SEED_STRIDE)
        for i, (o, n) in enumerate(zip(offsets, sizes))
    )
    return smaller_batch_fix(largest // plan.world_size, plan.world_size)


def train(run: Run, run_dir: RunDir, base: dict, evaluation=None):
    """``trainer.train()``; a failure or an interruption is written to the summary and the log
    (rank 0) before it propagates. The run's :class:`~cembed.train.checkpoint.InterruptCallback` is
    installed by the caller (it also covers the run's end). A signal during or after the last step
    stops the run only when its end (``evaluation``'s too) does not fit in ``train.stop_grace_seconds``
    (:mod:`cembed.train.stopping`; all ranks decide together).

    Returns:
        The trainer's ``TrainOutput``.

    Raises:
        RunFailed: a non-finite loss under ``train.nonfinite_loss: stop``; summary status "failed".
        RunInterrupted: SIGINT/SIGTERM; a checkpoint was saved and the summary says "interrupted".
        UserError: training ran 0 optimizer steps.
    """
    trainer, is_main = run.trainer, dist_info().is_main
    trainer.meter.start()
    try:
        result = trainer.train(resume_from_checkpoint=run_dir.checkpoint)
    except RunFailed as err:
        if is_main:
            append_log(run_dir.log_path, f"failed: {err}")
            last = latest_complete(run_dir.out)
            step = trainer.state.global_step
            write_json_atomic(run_dir.summary_path, failed_summary(base, err, step, str(last) if last else None, None))
        raise
    state, interrupt = trainer.state, run.interrupt
    # A signal during the end of training (the last step's save, the best checkpoint's load) may have
    # reached only some ranks so far: all go on or stop together.
    seen = max_over_ranks(interrupt.signum or 0)
    if seen and interrupt.signum is None:
        interrupt.signum, interrupt.at = seen, time.monotonic()
    last = trainer.last_checkpoint or run_dir.checkpoint  # (a resume of the last step saves none)
    at_last_step = bool(last) and Path(last).name == f"checkpoint-{state.global_step}"
    run.end.begin(base, state.global_step, last if at_last_step else None)  # a signal may still come
    if interrupt.signum is not None:
        ended = bool(state.max_steps) and state.global_step >= state.max_steps
        needed, _ = _end_needs(trainer, evaluation)
        if max_over_ranks(int(not ended or run.end.stops(needed))):
            if ended:  # the trained run's end does not fit in the grace: --resume does it
                raise run.end.stopped(FINAL_SAVE)
            err = RunInterrupted(interrupt.signum, state.global_step, trainer.last_checkpoint)
            step_losses = trainer.step_losses()  # on every rank (reduced when training ended: no collective left)
            if is_main:
                append_log(run_dir.log_path, f"{err}; checkpoint {trainer.last_checkpoint}")
                stopped = {
                    "status": "interrupted",
                    "steps": state.global_step,
                    "checkpoint": trainer.last_checkpoint,
                    "step_losses": step_losses,
                }
                write_json_atomic(run_dir.summary_path, {**base, **stopped})
            raise err
    if state.global_step == 0 and trainer.streaming:
        raise UserError(
            f"data.train.streaming: the stream gave no batch of {trainer.args.per_device_train_batch_size} rows "
            "(fewer rows per process, or too many sharing a text); lower batch.per_device_train_batch_size or raise "
            "data.train.streaming.window_batches"
        )
    if state.global_step == 0:
        raise UserError("training ran 0 optimizer steps; check train.max_steps / num_train_epochs and the data size")
    return result


def _end_needs(trainer: CembedTrainer, evaluation) -> tuple[float, float]:
    """What the run's end needs in seconds, ``(final save and evaluation, evaluation)``, from the
    last checkpoint save and the longest evaluation measured so far (:func:`cembed.train.stopping.end_estimate`)."""
    measured = [t for t in (trainer.eval_seconds, getattr(evaluation, "seconds", None)) if t is not None]
    return end_estimate(trainer.save_seconds, max(measured, default=None), evaluation is not None)


def write_summary(
    plan: Plan,
    run: Run,
    run_dir: RunDir,
    base: dict,
    result,
    data: TrainingData,
    evaluation=None,
    eval_before=None,
    prompts: RolePrompts | None = None,
) -> dict:
    """Save the model and evaluate it (rank 0), then write ``run_summary.json`` and the plot.
    ``prompts``: the run's prompts, saved as the model's ``query`` / ``document`` prompts
    (:func:`cembed.model.prompts.set_trained_prompts`; FSDP's gathered model is a fresh load).

    Returns:
        The completed run's summary (every rank gets it; only rank 0 writes anything).
    """
    trainer, log, state = run.trainer, run.log, run.trainer.state
    is_main = dist_info().is_main
    model = gathered_model(trainer, run.build_model)  # the best checkpoint with eval.metric_for_best_model
    lora = adapter_facts(trainer.model) | {"merged": plan.lora_merge} if is_lora(trainer.model) else None
    if model is not None:  # FSDP: rank 0 alone holds the gathered model (the others save nothing)
        add_card_facts(model, plan, base["data"]["rows_trained"], state.global_step)
        if prompts is not None:
            set_trained_prompts(model, prompts)
        finish_lora(model, bool(plan.lora_merge))  # model.lora.merge: plain weights in the saved folder
        cast_for_saving(model, plan.save_dtype)  # model.save_dtype; evaluated and pushed as saved
        forget_eval_results(model)  # the card's results are the final model's, from the evaluation below
    needs_all, needs_eval = _end_needs(trainer, evaluation)
    if is_main:  # a signal since the last step: finish, or stop where --resume does the rest
        run.end.enter(FINAL_SAVE, needs_all)
        save_model_atomic(model, run_dir.out)
        if evaluation:
            run.end.enter(EVALUATION, needs_eval)
    with trainer.eval_precision():  # as before and during training
        eval_after = evaluation.evaluate(model, "after training") if evaluation and is_main else None
    if eval_after is not None:  # its evaluators reported to the card: rewrite it (push_to_hub uploads it)
        from cembed.train.evaluation import headline_keys

        record_final_eval(model, eval_before, eval_after, headline_keys(evaluation.sets, evaluation.similarity))
        write_model_card(model, run_dir.out)
    push_final_model(trainer)  # train.push_to_hub: every rank calls it, rank 0 uploads
    wall = (log.ended or time.perf_counter()) - log.started  # this process's training time
    seen = samples_seen(trainer, state.global_step, plan.samples_per_step)
    # A resumed run trained only the steps after the checkpoint's in this process: its rate is theirs.
    start = log.clock.start_step
    here = seen - (samples_seen(trainer, start, plan.samples_per_step) if start else 0)
    summary = {
        "status": "completed",
        **base,
        "steps": state.global_step,
        "epochs": state.epoch,
        "samples_seen": seen,
        "steps_this_run": state.global_step - start,  # after the checkpoint's on a resume
        "samples_this_run": here,
        "data": {**base["data"], "sources": source_summary(data, trainer, state.global_step)},
        "wall_time_s": round(wall, 3),
        "samples_per_s": round(here / wall, 3) if wall > 0 else None,  # this process's rows / its wall time
        "train_loss": result.training_loss,
        "first_loss": log.losses[0][1] if log.losses else None,
        "last_loss": log.losses[-1][1] if log.losses else None,
        "losses": log.losses,
        "step_losses": trainer.step_losses(),  # every optimizer step's loss, the global step's (over all ranks)
        "nonfinite_steps_skipped": trainer.nonfinite_skipped,
        # what the loss chose as it ran (a MaxSim kernel, or why not)
        "loss_notes": list(trainer.built_loss.notes) if trainer.built_loss is not None else [],
        "throughput": trainer.meter.totals(),
        "lora": lora,
        "throughput_per_interval": trainer.meter.history,
        "eval": evaluation.summary(eval_before, eval_after, state, trainer.best_model_loaded) if evaluation else None,
    }
    summary |= run.end.finish()  # a stop signal since the last step, and the run finished all the same
    if not is_main:
        return summary
    curves = run_dir.out / "training_curves.png"
    title = f"{run_dir.out.name}: {display_path(plan.model.name_or_path)}"  # run folder: model
    plot = plot_run(log.losses, trainer.meter.history, plan.samples_per_step, curves, summary["step_losses"], title)
    summary["plot"] = str(plot) if plot else None
    write_json_atomic(run_dir.summary_path, summary)
    append_log(run_dir.log_path, f"completed: {state.global_step} steps; model in {run_dir.out}")
    return summary


def run_training(
    cfg: CembedConfig,
    plan: Plan,
    data: TrainingData,
    display: RunDisplay | None = None,
    resume: bool = False,
    resume_from: str | None = None,
    overwrite: bool = False,
    max_memory: str | None = None,
    trainer_cls: type[CembedTrainer] = CembedTrainer,
    warnings: tuple[str, ...] = (),
) -> dict:
    """Train ``cfg.model`` on ``data`` under ``plan`` and write the model and ``run_summary.json``.

    Args:
        display: what the run shows (probe, header, components, progress, evaluation lines;
            default :class:`QuietRunDisplay`, which shows nothing).
        resume: continue from the newest complete checkpoint in ``train.output_dir``; an attempt that
            torch's elastic agent restarted (any rank's ``$TORCHELASTIC_RESTART_COUNT`` > 0) does
            so without it, where such a checkpoint exists (:func:`cembed.train.checkpoint.resume_on_restart`).
        resume_from: continue from this checkpoint folder instead.
        overwrite: allow an ``output_dir`` that already holds a finished model.
        max_memory: memory budget for ``batch.mini_batch_size: auto`` (e.g. ``8GiB``).
        trainer_cls: the trainer class (tests pass a subclass of :class:`CembedTrainer`).
        warnings: the caller's findings before training (the rows the sampler cannot place:
            :attr:`cembed.train.facts.RunFacts.warnings`), printed and recorded with the plan's
            warnings, the data's and the changes a resume applies.

    Returns:
        The run summary (also written to ``<output_dir>/run_summary.json`` by rank 0).

    Raises:
        UserError, RunInterrupted: see the stages.
        RunFailed: a non-finite loss, or any unexpected exception in a stage (recorded in
            ``run_summary.json``, ``train.log`` and ``error_traceback.txt``; see :mod:`cembed.train.summary`).
    """
    display = display if display is not None else QuietRunDisplay()
    is_main = dist_info().is_main
    t = cfg.train
    # An attempt that torch's elastic agent restarted after a failure continues from the newest
    # complete checkpoint, as --resume does. The ranks decide together, in the process group (joined
    # here, before the output folder is read): a node whose workers were healthy restarts them with
    # a restart count of 0 (cembed.distributed.launch.job_restart_count).
    init_distributed(plan.device, cfg.distributed.timeout_minutes)
    restarts = job_restart_count()
    resume, resume_from = resume_on_restart(t.output_dir, restarts, resume, resume_from)
    record = training_record(
        cfg,
        plan.samples_per_step,
        plan.learning_rate,
        data.dataset,
        plan.precision,
        world_size=plan.world_size,
        contrast_rows=plan.contrast_rows,
    )
    run_dir = prepare_output(t.output_dir, t.max_steps, plan, resume, resume_from, overwrite, record)
    run_dir.restarts = restarts
    frozen = freezes_unused(recorded_run(run_dir.checkpoint) if run_dir.checkpoint else None, plan.world_size)
    record["frozen_unused_parameters"] = frozen  # each checkpoint carries it on (its optimizer's parameters)
    findings = (*data.warnings, *warnings, *(f"resume applies {c}" for c in run_dir.resume_changes))
    quiet_libraries()
    with failures_recorded(run_dir.out, is_main, Attempt()) as attempt:
        device, plan = resolve_runtime(cfg, plan, data, display, max_memory)
        display.run_header(cfg, plan, findings)
        if run_dir.checkpoint:
            step, planned = checkpoint_progress(run_dir.checkpoint)
            display.resuming(run_dir.checkpoint, step, planned or t.max_steps or 0)
        on_line = display.eval_line if is_main else None
        parts = build_components(cfg, plan, data, device, on_line, display.tokenize_progress, frozen)
        if is_main:
            fallback = parts.token_info.get("warning")
            display.components(parts.loss.unpadding, parts.distributed, (fallback,) if fallback else ())
        run = build_trainer(cfg, plan, parts, run_dir, display, trainer_cls)
        attempt.trainer = run.trainer
        if is_main:  # the card's training data: the sources by name, their text columns only
            describe_training_data(run.trainer, cfg.data.sources(), data)
        resuming = bool(run_dir.checkpoint)
        eval_before = run.trainer.evaluate_base_model(parts.evaluation, resuming, cfg.data.cache_dir)
        if eval_before is not None:
            mark_eval_before(parts.model)
        attempt.base = base = summary_base(cfg, plan, data, parts, run_dir, run, findings)
        run.end.base = base
        # Signals are handled from the first step to the summary (main thread only: signal handlers).
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:
            run.interrupt.install()
        try:
            result = train(run, run_dir, base, parts.evaluation)
            return write_summary(plan, run, run_dir, base, result, data, parts.evaluation, eval_before, parts.prompts)
        except RunAbandoned as err:
            _record_abandoned(err, run, run_dir, base)
            raise
        finally:
            if main_thread:
                run.interrupt.uninstall()


def _record_abandoned(err: RunAbandoned, run: Run, run_dir: RunDir, base: dict) -> None:
    """A second signal stopped the run at once: name what was abandoned on ``err`` (``err.stage``
    after the last step) and, on rank 0, write it to ``train.log`` and ``run_summary.json``
    (status ``abandoned``, the last complete checkpoint)."""
    err.stage = run.end.stage
    if not dist_info().is_main:
        return
    name, what = signal.Signals(err.signum).name, err.what
    append_log(run_dir.log_path, f"abandoned: second {name} during {what}; not saved")
    last = latest_complete(run_dir.out)
    abandoned = {
        "status": "abandoned",
        "signal": name,
        "steps": run.trainer.state.global_step,
        "abandoned": what,
        "last_checkpoint": str(last) if last else None,
    }
    write_json_atomic(run_dir.summary_path, {**base, **abandoned})
