"""The trainer: sentence-transformers' ``SentenceTransformerTrainer`` plus what cembed adds to a run.

:func:`build_training_args` turns the config and the resolved plan into the trainer's arguments.

:class:`CembedTrainer` takes its collaborators as constructor arguments:

- ``meter`` (:class:`~cembed.meter.ThroughputMeter`): every wait for the next batch is timed, and
  each training log gets the interval's data-wait share, tokens/s and padded share;
- ``nonfinite_policy``: a NaN/inf loss stops the run naming the step and the last good checkpoint
  (``"stop"``, :class:`~cembed.errors.RunFailed`) or turns the step into a no-op and counts it
  (``"skip"``);
- every optimizer step's loss is kept (:meth:`CembedTrainer.step_losses`; detached tensors, turned
  into numbers in bulk at each training log, so no host sync per mini-batch);
- checkpoints are written into a staging folder, marked complete and renamed into place, so a save
  cut short is never resumed from (see :mod:`cembed.checkpoint`).

:class:`RunLogCallback` records what a run logged (losses, learning rate, wall time) for the run
summary and appends one line per logging interval to ``output_dir/train.log``; it prints nothing
(the progress display is :class:`cembed.report.RichProgressCallback`).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformerTrainer
from transformers import TrainerCallback

from cembed.checkpoint import STAGING, latest_complete, mark_complete
from cembed.config import CembedConfig
from cembed.errors import RunFailed, UserError, first_line
from cembed.meter import ThroughputMeter
from cembed.outputs import append_log
from cembed.plan import Plan
from cembed.sampler import NoDuplicatesSampler


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


class CembedTrainer(SentenceTransformerTrainer):
    """``SentenceTransformerTrainer`` with a throughput meter, a non-finite-loss policy and atomic
    checkpoints.

    Args:
        *args, **kwargs: as for ``SentenceTransformerTrainer``.
        meter: times data waits and adds its statistics to every training log; None: no meter.
        nonfinite_policy: ``"stop"`` (raise :class:`~cembed.errors.RunFailed`) or ``"skip"``.
    """

    def __init__(self, *args, meter: ThroughputMeter | None = None, nonfinite_policy: str = "stop", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.meter = meter
        self.nonfinite_policy = nonfinite_policy
        self.nonfinite_skipped = 0
        self.last_checkpoint: str | None = None
        self._train_dataloader = None
        self._staging_root: str | None = None
        self._pending_losses: list[tuple[int, torch.Tensor]] = []  # (step, detached loss) per micro-batch
        self._step_losses: dict[int, float] = {}
        self._skipped_steps: set[int] = set()

    # --- the throughput meter ----------------------------------------------------------------

    def get_train_dataloader(self):
        # Built once: its sampler hashes every text, and the recipe reads its length before
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
        if "loss" in logs:
            self._flush_step_losses()
            if self.meter is not None:
                logs = {**logs, **self.meter.snapshot(self.state.global_step)}
        return super().log(logs, *args, **kwargs)

    # --- every optimizer step's loss -----------------------------------------------------------

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)  # detached, divided by the accumulation steps
        self._pending_losses.append((self.state.global_step + 1, loss.detach()))
        return loss

    def _flush_step_losses(self) -> None:
        if not self._pending_losses:
            return
        values = torch.stack([v.float().reshape(()) for _, v in self._pending_losses]).tolist()  # one sync
        for (step, _), value in zip(self._pending_losses, values):
            self._step_losses[step] = self._step_losses.get(step, 0.0) + value
        self._pending_losses.clear()

    def step_losses(self) -> list[tuple[int, float]]:
        """``(step, loss)`` for every optimizer step this process trained (the sum over its
        accumulated mini-batches of loss / accumulation steps, as the logged loss averages it);
        steps skipped for a non-finite loss are left out."""
        self._flush_step_losses()
        return [(s, v) for s, v in sorted(self._step_losses.items()) if s not in self._skipped_steps]

    # --- non-finite loss: stop naming the step and the last good checkpoint, or skip -----------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        value = out[0] if return_outputs else out
        if bool(torch.isfinite(value.detach()).all()):
            return out
        step = self.state.global_step + 1
        if self.nonfinite_policy == "skip":
            # A fresh leaf: backward reaches no parameter, so the optimizer step changes nothing.
            self.nonfinite_skipped += 1
            self._skipped_steps.add(step)
            zero = torch.zeros((), device=value.device, requires_grad=True)
            return (zero, out[1]) if return_outputs else zero
        last = latest_complete(self.args.output_dir)
        raise RunFailed(
            f"loss is {float(value.detach())} at step {step}; training stopped. Last good checkpoint: "
            f"{last or 'none (set train.save_steps to keep checkpoints)'}. Lower optim.learning_rate and "
            "resume with --resume, or set train.nonfinite_loss: skip"
        )

    # --- atomic checkpoints: staged, marked complete, then renamed into place ------------------

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


@dataclass
class RunLog:
    """What a run logged: ``(step, loss)`` per logging interval, the last loss and LR, wall times."""

    losses: list[tuple[int, float]] = field(default_factory=list)
    last_loss: float = float("nan")
    last_lr: float = float("nan")
    started: float = 0.0
    ended: float = 0.0

    def samples_per_s(self, step: int, samples_per_step: int) -> float:
        """Samples trained per second since the run started (0.0 before any time passed)."""
        elapsed = time.perf_counter() - self.started
        return step * samples_per_step / elapsed if elapsed > 0 else 0.0


def progress_line(step: int, max_steps: int, log: RunLog, samples_per_step: int, logs: dict) -> str:
    """One logging interval as text: step, loss, LR, samples/s and the meter's statistics."""
    meter = ""
    if "data_wait" in logs:
        meter = (
            f"  {logs['tokens_per_s']:.0f} tok/s  data-wait {100 * logs['data_wait']:.1f}%  "
            f"padding {100 * logs['padded_share']:.1f}%"
        )
    return (
        f"step {step}/{max_steps}  loss {log.last_loss:.4f}  lr {log.last_lr:.3e}  "
        f"{log.samples_per_s(step, samples_per_step):.1f} samples/s{meter}"
    )


class RunLogCallback(TrainerCallback):
    """Fills a :class:`RunLog`; on the main process also appends each interval's
    :func:`progress_line` to ``log_path`` and hands it to ``on_line`` (the progress display)."""

    def __init__(
        self,
        log: RunLog,
        samples_per_step: int,
        log_path: Path | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self.log = log
        self.samples_per_step = samples_per_step
        self.log_path = log_path
        self.on_line = on_line

    def on_train_begin(self, args, state, control, **kwargs):
        self.log.started = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "learning_rate" in logs:
            self.log.last_lr = float(logs["learning_rate"])
        if "loss" not in logs:
            return
        self.log.last_loss = float(logs["loss"])
        self.log.losses.append((state.global_step, self.log.last_loss))
        if not state.is_world_process_zero:
            return
        line = progress_line(state.global_step, state.max_steps, self.log, self.samples_per_step, logs)
        if self.on_line is not None:
            self.on_line(line)
        if self.log_path is not None:
            append_log(self.log_path, line)

    def on_train_end(self, args, state, control, **kwargs):
        self.log.ended = time.perf_counter()
