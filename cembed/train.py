"""``cembed train``: config -> plan -> data -> sampler -> loss -> sentence-transformers trainer -> outputs.

Each stage takes the previous stage's output; nothing here reads the YAML again.
"""

from __future__ import annotations

import os
import platform
import shutil
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import TrainerCallback

from cembed.checkpoint import (
    STAGING,
    InterruptCallback,
    check_output_dir,
    check_resume_point,
    latest_complete,
    mark_complete,
    remove_incomplete,
    resolve_resume,
)
from cembed.config import CembedConfig
from cembed.data import PreparedData, check_batchable, prepare_data
from cembed.distributed import backend_for, dist_info, freeze_unused_parameters, init_distributed, local_main_first
from cembed.errors import RunFailed, RunInterrupted, UserError, first_line
from cembed.losses import build_loss
from cembed.meter import ThroughputMeter, plot_run
from cembed.model import load_model, quiet_libraries
from cembed.outputs import append_log, save_model_atomic, write_json_atomic
from cembed.plan import Plan, resolve_plan
from cembed.pretokenize import collator_for, matches_model_preprocessing, pretokenize
from cembed.sampler import NoDuplicatesSampler


@dataclass
class RunLog:
    """What the progress callback saw: logged losses and timing."""

    losses: list[tuple[int, float]] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0


class RichProgressCallback(TrainerCallback):
    """Progress bar (step, loss, LR, samples/s, ETA) and one log line per logging interval."""

    def __init__(
        self, console: Console, samples_per_step: int, log: RunLog, enabled: bool = True, log_path: Path | None = None
    ) -> None:
        self.console = console
        self.log_path = log_path
        self.samples_per_step = samples_per_step
        self.log = log
        self.enabled = enabled
        self.progress: Progress | None = None
        self.task = None
        self._last = {"loss": float("nan"), "lr": float("nan")}

    def on_train_begin(self, args, state, control, **kwargs):
        self.log.started = time.perf_counter()
        if not (self.enabled and state.is_world_process_zero):
            return
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=state.max_steps, info="")

    def _rate(self, step: int) -> float:
        elapsed = time.perf_counter() - self.log.started
        return step * self.samples_per_step / elapsed if elapsed > 0 else 0.0

    def _refresh(self, step: int) -> None:
        if self.progress is not None:
            info = f"loss {self._last['loss']:.4f}  lr {self._last['lr']:.2e}  {self._rate(step):.1f} samples/s"
            self.progress.update(self.task, completed=step, info=info)

    def on_step_end(self, args, state, control, **kwargs):
        self._refresh(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" in logs:
            self.log.losses.append((state.global_step, float(logs["loss"])))
            self._last["loss"] = float(logs["loss"])
        if "learning_rate" in logs:
            self._last["lr"] = float(logs["learning_rate"])
        self._refresh(state.global_step)
        if "loss" in logs and state.is_world_process_zero:
            meter = ""
            if "data_wait" in logs:
                meter = (
                    f"  {logs['tokens_per_s']:.0f} tok/s  data-wait {100 * logs['data_wait']:.1f}%  "
                    f"padding {100 * logs['padded_share']:.1f}%"
                )
            line = (
                f"step {state.global_step}/{state.max_steps}  loss {self._last['loss']:.4f}  "
                f"lr {self._last['lr']:.3e}  {self._rate(state.global_step):.1f} samples/s{meter}"
            )
            if self.progress is not None:
                self.progress.console.print(line)
            if self.log_path is not None:
                append_log(self.log_path, line)

    def on_train_end(self, args, state, control, **kwargs):
        self.log.ended = time.perf_counter()
        if self.progress is not None:
            self.progress.stop()


def tokenize_stage(model, data: PreparedData, enabled: bool, cache_dir: str | None):
    """Pre-tokenize the training data for ``model`` (cached), or leave tokenizing to the collator.

    Returns:
        ``(dataset, collator or None, info)``: ``collator`` is ``None`` when the stock
        sentence-transformers collator (tokenizing on the fly) is used, and ``info`` says why.
    """
    roles = data.columns
    if not enabled:
        return data.dataset, None, {"pretokenized": False, "reason": "data.pretokenize is false"}
    collator = collator_for(model, roles)
    if collator is None:
        return data.dataset, None, {"pretokenized": False, "reason": "the model's features are not plain token ids"}
    started = time.perf_counter()
    result = pretokenize(data.dataset, roles, model.tokenizer, model.max_seq_length, cache_dir)
    if not matches_model_preprocessing(model, collator, result.dataset):
        return data.dataset, None, {"pretokenized": False, "reason": "stored ids differ from the model's preprocessing"}
    info = {
        "pretokenized": True,
        "from_cache": result.from_cache,
        "cache_path": str(result.cache_path),
        "seconds": round(time.perf_counter() - started, 3),
    }
    return result.dataset, collator, info


def _trainer_class():
    from sentence_transformers import SentenceTransformerTrainer

    class CembedTrainer(SentenceTransformerTrainer):
        """The sentence-transformers trainer, plus the throughput meter: it times every wait for
        the next batch and adds data-wait, tokens/s and padded share to each training log."""

        meter: ThroughputMeter | None = None
        _train_dataloader = None

        def get_train_dataloader(self):
            # Built once: its sampler hashes every text, and run_training reads its length before
            # train() asks for it again.
            if self._train_dataloader is None:
                self._train_dataloader = super().get_train_dataloader()
            return self._train_dataloader

        def get_batch_samples(self, *args, **kwargs):
            started = time.perf_counter()
            out = super().get_batch_samples(*args, **kwargs)
            if self.meter is not None:
                self.meter.waited(time.perf_counter() - started)
            return out

        def log(self, logs, *args, **kwargs):
            if self.meter is not None and "loss" in logs:
                logs = {**logs, **self.meter.snapshot(self.state.global_step)}
            return super().log(logs, *args, **kwargs)

        # --- non-finite loss: stop naming the step and the last good checkpoint, or skip ---
        nonfinite_policy: str = "stop"
        nonfinite_skipped: int = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
            value = out[0] if return_outputs else out
            if bool(torch.isfinite(value.detach()).all()):
                return out
            step = self.state.global_step + 1
            if self.nonfinite_policy == "skip":
                # A fresh leaf: backward reaches no parameter, so the optimizer step changes nothing.
                self.nonfinite_skipped += 1
                zero = torch.zeros((), device=value.device, requires_grad=True)
                return (zero, out[1]) if return_outputs else zero
            last = latest_complete(self.args.output_dir)
            raise RunFailed(
                f"loss is {float(value.detach())} at step {step}; training stopped. Last good checkpoint: "
                f"{last or 'none (set train.save_steps to keep checkpoints)'}. Lower optim.learning_rate and "
                "resume with --resume, or set train.nonfinite_loss: skip"
            )

        # --- atomic checkpoints: staged, marked complete, then renamed into place ---
        _staging_root: str | None = None
        last_checkpoint: str | None = None

        def _get_output_dir(self, trial):
            return self._staging_root or super()._get_output_dir(trial)

        def _save_checkpoint(self, model, trial):
            from transformers.trainer_utils import rotate_checkpoints

            run_dir = super()._get_output_dir(trial)
            name = f"checkpoint-{self.state.global_step}"
            staging_root = os.path.join(run_dir, STAGING)
            staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
            if self.args.should_save:
                shutil.rmtree(staged, ignore_errors=True)
            self._staging_root = staging_root
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging_root = None
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                mark_complete(staged, self.state.global_step)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(staged, final)
                best = self.state.best_model_checkpoint
                if best and best.startswith(staging_root):
                    self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
                rotate_checkpoints(
                    output_dir=run_dir,
                    save_total_limit=self.args.save_total_limit,
                    best_model_checkpoint=self.state.best_model_checkpoint,
                )
            self.accelerator.wait_for_everyone()
            self.last_checkpoint = final

    return CembedTrainer


def build_training_args(cfg: CembedConfig, plan: Plan, eval_args: dict | None = None):
    """SentenceTransformerTrainingArguments from the config and the resolved plan (scaled LR);
    ``eval_args`` (from :func:`cembed.evaluate.training_eval_args`) override the save/eval settings.

    Raises:
        UserError: a ``train.report_to`` tracker whose package is missing.
    """
    from sentence_transformers import SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import BatchSamplers

    t = cfg.train
    length = {"max_steps": t.max_steps} if t.max_steps else {"num_train_epochs": t.num_train_epochs}
    ddp = {}
    if plan.world_size > 1:
        # run_training froze the parameters that get no gradient, so DDP needs no unused-parameter
        # search; every rank needs full, equal batches (the sampler only yields whole global batches).
        # The process group (nccl/gloo) is joined by init_distributed; accelerate reuses it.
        ddp = {"ddp_find_unused_parameters": False}
    kwargs = dict(
        output_dir=t.output_dir,
        per_device_train_batch_size=plan.per_device_train_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        learning_rate=plan.learning_rate,
        warmup_ratio=cfg.optim.warmup_ratio,
        weight_decay=cfg.optim.weight_decay,
        lr_scheduler_type=cfg.optim.lr_scheduler_type,
        seed=t.seed,
        data_seed=t.seed,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500,
        save_total_limit=t.save_total_limit,
        batch_sampler=NoDuplicatesSampler if cfg.sampler.no_duplicates else BatchSamplers.BATCH_SAMPLER,
        dataloader_drop_last=cfg.batch.drop_last or plan.world_size > 1,
        bf16=plan.precision == "bf16",
        fp16=plan.precision == "fp16",
        use_cpu=plan.device == "cpu",
        report_to="none" if t.report_to == ["none"] else list(t.report_to),
        disable_tqdm=True,
        dataloader_num_workers=t.dataloader_num_workers,
        **length,
        **ddp,
    )
    kwargs.update(eval_args or {})
    try:
        return SentenceTransformerTrainingArguments(**kwargs)
    except (ValueError, ImportError, RuntimeError) as err:
        if t.report_to != ["none"] and any(name in str(err) for name in t.report_to):
            raise UserError(f"train.report_to: {first_line(err)}") from None
        raise


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("cembed", "torch", "transformers", "sentence-transformers", "datasets"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def run_training(
    cfg: CembedConfig,
    plan: Plan,
    data: PreparedData,
    console: Console | None = None,
    progress: bool = True,
    resume: bool = False,
    resume_from: str | None = None,
    overwrite: bool = False,
) -> dict:
    """Train ``cfg.model`` on ``data`` under ``plan`` and write the model and ``run_summary.json``.

    In a multi-process job (``plan.world_size > 1``, started by :func:`cembed.distributed.launch`)
    every rank runs this; each joins the process group, trains on its slice of every global batch,
    and only rank 0 prints progress, saves the model and writes the summary.

    Args:
        resume: continue from the newest complete checkpoint in ``train.output_dir``.
        resume_from: continue from this checkpoint folder instead.
        overwrite: allow an ``output_dir`` that already holds a finished model.

    Returns:
        The run summary (also written to ``<output_dir>/run_summary.json`` by rank 0).

    Raises:
        UserError: the model cannot be loaded, the output folder holds a finished model, there is
            no checkpoint to resume, or the sampler yields no batch (a run never "succeeds" with 0
            steps).
        RunFailed: a non-finite loss (``train.nonfinite_loss: stop``); the summary says "failed".
        RunInterrupted: SIGINT/SIGTERM; a checkpoint was saved and the summary says "interrupted".
    """
    from transformers.trainer_callback import PrinterCallback

    rank = dist_info()
    out = Path(cfg.train.output_dir)
    # Resuming a checkpoint of another folder into a finished output_dir still needs --overwrite.
    continuing = resume or bool(resume_from and Path(resume_from).resolve().parent == out.resolve())
    check_output_dir(out, overwrite, continuing)
    checkpoint = resolve_resume(out, resume, resume_from)
    if checkpoint:
        check_resume_point(checkpoint, cfg.train.max_steps)
    log_path = out / "train.log"
    if rank.is_main:
        out.mkdir(parents=True, exist_ok=True)
        remove_incomplete(out)  # a half-written checkpoint from a killed run is never used
        append_log(
            log_path, f"start: {'resume from ' + checkpoint if checkpoint else 'fresh run'}; lr {plan.lr_derivation}"
        )

    console = console or Console()
    quiet_libraries()
    device = init_distributed(plan.device)
    model = load_model(cfg.model, device)
    with local_main_first():  # one process per node fills the tokenization cache, the others load it
        train_dataset, collator, token_info = tokenize_stage(model, data, cfg.data.pretokenize, cfg.data.cache_dir)
    b = cfg.batch
    built = build_loss(
        model,
        cfg.loss,
        plan.mini_batch_size,
        gather_across_devices=plan.gather_across_devices,
        mini_batch_num_tokens=b.mini_batch_num_tokens,
        sort_by_length=b.sort_by_length,
    )
    distributed = None
    if plan.world_size > 1:
        frozen = freeze_unused_parameters(model, data.dataset[:2]["anchor"])
        distributed = {
            "world_size": plan.world_size,
            "backend": backend_for(plan.device),
            "gather_across_devices": plan.gather_across_devices,
            "frozen_unused_parameters": frozen,
            "find_unused_parameters": False,
        }
        if rank.is_main:
            shown = ", ".join(frozen[:4]) + (f" and {len(frozen) - 4} more" if len(frozen) > 4 else "")
            console.print(
                f"distributed: {plan.world_size} processes ({distributed['backend']}), gather_across_devices="
                f"{str(plan.gather_across_devices).lower()}; "
                + (
                    f"froze {len(frozen)} parameters that never receive a gradient ({shown}), "
                    if frozen
                    else "every parameter receives a gradient, "
                )
                + "DDP unused-parameter detection off",
                highlight=False,
            )
    evaluation = None
    if cfg.eval is not None:
        from cembed.evaluate import TrainingEvaluation

        evaluation = TrainingEvaluation.from_config(
            cfg.eval,
            cfg.train.save_steps,
            on_line=(lambda line: console.print(line, highlight=False)) if (progress and rank.is_main) else None,
        )
    args = build_training_args(cfg, plan, evaluation.training_args if evaluation else None)
    log = RunLog()
    eval_before = None
    if evaluation and rank.is_main and not checkpoint:  # the base model's corpus embeddings are cached across runs
        from cembed.embedding_cache import default_cache_dir

        eval_before = evaluation.evaluate(model, "before training", cache_dir=default_cache_dir())
    trainer = _trainer_class()(
        model=model,
        args=args,
        train_dataset=train_dataset,
        loss=built.module,
        data_collator=collator,
        evaluator=evaluation.evaluator if evaluation else None,
    )
    trainer.meter = ThroughputMeter(built.token_counts)
    trainer.nonfinite_policy = cfg.train.nonfinite_loss
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(
        RichProgressCallback(
            console, plan.samples_per_step, log, enabled=progress, log_path=log_path if rank.is_main else None
        )
    )
    interrupt = InterruptCallback()
    trainer.add_callback(interrupt)
    if evaluation:
        trainer.add_callback(evaluation.callback)

    sampler = trainer.get_train_dataloader().batch_sampler
    batches_per_epoch = len(sampler)  # per rank (accelerate's shard wrapper) = optimizer steps per epoch
    sampler = getattr(sampler, "batch_sampler", sampler)
    if batches_per_epoch == 0:
        raise UserError(
            f"{data.source}: the no-duplicates sampler cannot fill a single batch of {plan.per_device_train_batch_size} "
            "rows; lower batch.per_device_train_batch_size"
        )

    base = {
        # The config as run: batch.mini_batch_size: auto shows the probed size.
        "config": cfg.model_copy(
            update={"batch": cfg.batch.model_copy(update={"mini_batch_size": plan.mini_batch_size})}
        ).model_dump(mode="json"),
        "plan": plan.to_dict(),
        "learning_rate": {"effective": plan.learning_rate, "derivation": plan.lr_derivation},
        "data": {
            "source": data.source,
            "rows_read": data.rows_read,
            "rows_dropped_invalid": data.rows_dropped,
            "rows_trained": len(data.dataset),
            "columns": data.roles,
            "batches_per_epoch": batches_per_epoch,
            "rows_unplaced_first_epoch": getattr(sampler, "unplaced", 0),
        },
        "resumed_from": checkpoint,
        "tokenization": token_info,
        "device": plan.device,
        "distributed": distributed,
        "versions": _versions(),
        "output_dir": str(out),
        "mini_batch_probe": plan.mini_batch_probe,
    }
    summary_path = out / "run_summary.json"
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        interrupt.install()
    trainer.meter.start()
    try:
        result = trainer.train(resume_from_checkpoint=checkpoint)
    except RunFailed as err:
        if rank.is_main:
            append_log(log_path, f"failed: {err}")
            write_json_atomic(
                summary_path, {**base, "status": "failed", "error": str(err), "steps": trainer.state.global_step}
            )
        raise
    finally:
        if main_thread:
            interrupt.uninstall()
    state = trainer.state
    if interrupt.signum is not None:
        err = RunInterrupted(interrupt.signum, state.global_step, trainer.last_checkpoint)
        if rank.is_main:
            append_log(log_path, f"{err}; checkpoint {trainer.last_checkpoint}")
            write_json_atomic(
                summary_path,
                {**base, "status": "interrupted", "steps": state.global_step, "checkpoint": trainer.last_checkpoint},
            )
        raise err
    if state.global_step == 0:
        raise UserError("training ran 0 optimizer steps; check train.max_steps / num_train_epochs and the data size")

    model = trainer.model  # the best checkpoint when eval.metric_for_best_model is set
    if rank.is_main:
        save_model_atomic(model, out)
    eval_after = evaluation.evaluate(model, "after training") if evaluation and rank.is_main else None
    wall = (log.ended or time.perf_counter()) - log.started
    samples_seen = state.global_step * plan.samples_per_step
    summary = {
        "status": "completed",
        **base,
        "steps": state.global_step,
        "epochs": state.epoch,
        "samples_seen": samples_seen,
        "wall_time_s": round(wall, 3),
        "samples_per_s": round(samples_seen / wall, 3) if wall > 0 else None,
        "train_loss": result.training_loss,
        "first_loss": log.losses[0][1] if log.losses else None,
        "last_loss": log.losses[-1][1] if log.losses else None,
        "losses": log.losses,
        "nonfinite_steps_skipped": trainer.nonfinite_skipped,
        "throughput": trainer.meter.totals(),
        "throughput_per_interval": trainer.meter.history,
        "eval": evaluation.summary(eval_before, eval_after, state) if evaluation else None,
    }
    if not rank.is_main:
        return summary
    plot = plot_run(log.losses, trainer.meter.history, plan.samples_per_step, out / "training_curves.png")
    summary["plot"] = str(plot) if plot else None
    write_json_atomic(summary_path, summary)
    append_log(log_path, f"completed: {state.global_step} steps; model in {out}")
    return summary


def check_run_inputs(cfg: CembedConfig, world_size: int | None = None) -> tuple[Plan, PreparedData]:
    """Resolve the plan and load/check the training data (everything ``validate`` checks)."""
    plan = resolve_plan(cfg, world_size)
    data = prepare_data(cfg.data)
    check_batchable(data, plan.per_device_train_batch_size * plan.world_size, cfg.sampler.no_duplicates)
    if cfg.eval is not None:  # load the eval sets once here so `validate` reports their mistakes
        from cembed.evaluate import check_metric_name, load_eval_sets, training_eval_args

        metric = check_metric_name(cfg.eval.metric_for_best_model, load_eval_sets(cfg.eval))
        training_eval_args(cfg.eval, metric, cfg.train.save_steps)
    return plan, data
