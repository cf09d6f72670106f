"""The trainer: sentence-transformers' ``SentenceTransformerTrainer`` plus what cembed adds to a run.

:func:`cembed.train.args.build_training_args` turns the config and the resolved plan into the trainer's arguments.

:class:`CembedTrainer` takes its collaborators as constructor arguments:

- ``meter`` (:class:`~cembed.train.meter.ThroughputMeter`): every wait for the next batch is timed, and
  each training log gets the interval's data-wait share, tokens/s, padded share, model FLOP/s and MFU
  (the loss's token counts stay on the device until then: no host read per mini-batch);
- ``nonfinite_policy``: a NaN/inf loss stops the run naming the step and the last good checkpoint
  (``"stop"``, :class:`~cembed.errors.RunFailed`) or turns the optimizer step into a no-op and
  counts it (``"skip"``). The decision is taken by all ranks together (one max all-reduce per
  micro-batch), and the skipped step still runs its backward, so every rank issues the same
  collectives (DDP's all-reduce, the gathered loss's backward) whatever the loss value; only the
  optimizer update is dropped, in a way fp16's GradScaler accepts (see :meth:`CembedTrainer.skip_pending_step`);
- every optimizer step's loss is kept (:meth:`CembedTrainer.step_losses`; detached tensors, turned
  into numbers at each step's end, so no host sync per mini-batch): the global step's, each rank's
  share averaged over the ranks (one all-gather per step), as the logged loss averages it;
- checkpoints are written into a staging folder, marked complete and renamed into place, so a save
  cut short is never resumed from (see :mod:`cembed.train.checkpoint`).

:class:`RunLogCallback` records what a run logged (losses, learning rate, wall time) for the run
summary and appends one line per logging interval to ``output_dir/train.log``; it prints nothing
(the progress display comes from the run's :class:`cembed.train.recipe.RunDisplay`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformerTrainer
from torch.utils.data import DataLoader
from transformers import TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME

from cembed.data.batching.stream import StreamingRows
from cembed.data.tokens.collator import PaddingCollator, SourceNamedRows, TextCollator, TokenIdRows
from cembed.distributed.collectives import (
    gather_over_ranks,
    max_over_ranks,
    reduce_over_ranks,
    require_same_on_all_ranks,
)
from cembed.distributed.fsdp import (
    enable_fsdp_on_cpu,
    load_full_optimizer,
    load_sharded_model,
    load_sharded_optimizer,
    search_final_norm_in_backbone,
)
from cembed.distributed.group import main_first
from cembed.errors import RunFailed, UserError, first_line
from cembed.files import append_log, apply_umask
from cembed.losses.counts import TokenCounts
from cembed.losses.registry import BuiltLoss
from cembed.model.lora import is_lora, load_lora_checkpoint
from cembed.plan.precision import autocast, precision_from_flags
from cembed.train.checkpoint import (
    STAGING,
    holds_rng_states,
    is_complete,
    is_sharded_checkpoint,
    latest_complete,
    mark_complete,
    read_step_losses,
    reseeded,
    worker_init,
    write_step_losses,
)
from cembed.train.flops import format_flops
from cembed.train.meter import StepClock, ThroughputMeter


class CembedTrainer(SentenceTransformerTrainer):
    """``SentenceTransformerTrainer`` with a throughput meter, a non-finite-loss policy and atomic
    checkpoints.

    Args:
        *args, **kwargs: as for ``SentenceTransformerTrainer``.
        meter: times data waits and adds its statistics to every training log; None: no meter.
        nonfinite_policy: ``"stop"`` (raise :class:`~cembed.errors.RunFailed`) or ``"skip"``.
        built_loss: the :class:`~cembed.losses.registry.BuiltLoss` whose ``module`` is ``loss``: its
            mini-batching is what :meth:`collective_facts` compares across ranks (None: the class only).
        card_dataset: what the model card describes as the training data instead of ``train_dataset``
            (sources with different columns: a ``DatasetDict`` of each source's own columns, since the
            card's statistics cannot read the null cells of the columns a source does not map).
        data_facts: more facts every rank must share (:meth:`collective_facts`), e.g. a prepared
            source's fingerprint (``{"prepared": ...}``): ranks that read different data are refused.

    Without pre-tokenization the collator is :class:`~cembed.data.tokens.collator.TextCollator` (a batch
    carries only its source's columns); with per-source prompts (``args.prompts`` keyed by source
    name) the training rows carry their source's name (:class:`~cembed.data.tokens.collator.SourceNamedRows`,
    from :attr:`source_rows`: ``(names, sizes)``, set before the data loader is built).
    """

    data_collator_class = TextCollator

    def __init__(
        self,
        *args,
        meter: ThroughputMeter | None = None,
        nonfinite_policy: str = "stop",
        built_loss: BuiltLoss | None = None,
        card_dataset=None,
        data_facts: dict[str, object] | None = None,
        **kwargs,
    ) -> None:
        self._card_dataset = card_dataset
        self._data_facts = dict(data_facts or {})
        super().__init__(*args, **kwargs)
        self.built_loss = built_loss
        self.meter = meter
        if meter is not None:
            meter.gather = gather_over_ranks  # the job's tokens/s and data-wait, not rank 0's alone
        self.nonfinite_policy = nonfinite_policy
        self.nonfinite_skipped = 0
        self._skip_step = False
        self.add_callback(SkipNonfiniteCallback(self))
        require_same_on_all_ranks(self.collective_facts())
        self.last_checkpoint: str | None = None
        self.save_seconds: float | None = None  # how long the last checkpoint took to save (all ranks)
        self.eval_seconds: float | None = None  # how long the last evaluation during training took
        self.best_model_loaded = False  # the best checkpoint's weights were loaded at the end of training
        self._loaded_checkpoint: str | None = None  # the checkpoint _load_from_checkpoint last loaded in full
        self.run_record: dict | None = None  # stored in each checkpoint's marker, compared on resume
        self._preloaded_checkpoint: str | None = None  # a full checkpoint loaded before FSDP sharded the model
        self.source_rows: tuple[list[str], list[int]] | None = None  # per-source prompts without pre-tokenization
        self._train_dataloader = None
        self._staging_root: str | None = None
        self._pending_losses: list[tuple[int, torch.Tensor]] = []  # (step, detached loss) per micro-batch
        self._step_losses: dict[int, float] = {}  # this process's share of each step's loss
        self._global_losses: dict[int, float] = {}  # each step's loss over all ranks (_reduce_step_losses)
        self._skipped_steps: set[int] = set()

    def preprocess_dataset(self, dataset, *args, **kwargs):
        # A stream's rows are role columns already (no dataset-name column to add, nothing to validate).
        if isinstance(dataset, StreamingRows):
            return dataset
        return super().preprocess_dataset(dataset, *args, **kwargs)

    def add_model_card_callback(self, default_args_dict: dict) -> None:
        # sentence-transformers' card reads ``self.train_dataset`` once, here (datasets, widget examples).
        if self._card_dataset is None:
            return super().add_model_card_callback(default_args_dict)
        train, self.train_dataset = self.train_dataset, self._card_dataset
        try:
            super().add_model_card_callback(default_args_dict)
        finally:
            self.train_dataset = train

    def collective_facts(self) -> dict[str, object]:
        """What decides the collectives a training step issues: the loss and its mini-batching
        (``mini_batch_size`` from ``auto`` included), the columns, rows per rank, accumulation,
        precision, sequence length and the training rows. Every rank must have the same; the
        constructor refuses a job whose ranks differ (:func:`~cembed.distributed.collectives.require_same_on_all_ranks`)."""
        args, data = self.args, self.train_dataset
        built = self.built_loss or BuiltLoss(self.loss, TokenCounts(), cached=False)
        return {
            **built.collective_facts(),
            "columns": list(getattr(data, "column_names", None) or []),
            "rows": len(data) if data is not None and not self.streaming else None,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "max_steps": args.max_steps,
            "num_train_epochs": args.num_train_epochs,
            "precision": precision_from_flags(args.bf16, args.fp16),
            "max_seq_length": getattr(self.model, "max_seq_length", None),
            **getattr(self, "_data_facts", {}),
        }

    def eval_precision(self):
        """The precision every evaluation runs in: the training precision's autocast (bf16/fp16,
        what accelerate wraps the model's forward in for training and for evaluation during and
        after it), or none for fp32. Used around the evaluations before and after training, so
        before -> during -> after differences are training effects, not a precision change."""
        return autocast(precision_from_flags(self.args.bf16, self.args.fp16), self.model.device.type)

    def evaluate_base_model(self, evaluation, resuming: bool = False, cache_dir: str | None = None) -> dict | None:
        """Evaluate the model "before training" on rank 0, in :meth:`eval_precision` (``None`` when
        resuming, without evaluation, and on the other ranks). The other ranks wait for it on the
        process group's store, not in a collective (:func:`~cembed.distributed.group.main_first`), so a
        long evaluation is not cut off by the collective timeout. The base model's corpus
        embeddings are cached across runs, in :func:`cembed.files.cache_root` ``("embeddings", cache_dir)``
        (``cache_dir``: ``data.cache_dir``; None: the default root)."""
        if evaluation is None or resuming:
            return None
        with main_first(run_on_others=False) as runs_here:
            if not runs_here:
                return None
            from cembed.files import cache_root

            with self.eval_precision():
                return evaluation.evaluate(self.model, "before training", cache_dir=cache_root("embeddings", cache_dir))

    def init_hf_repo(self, *args, **kwargs) -> None:
        # Creating the hub repo (train.push_to_hub) needs the network and a token: say so in one line.
        try:
            super().init_hf_repo(*args, **kwargs)
        except Exception as err:
            raise UserError(
                f"train.push_to_hub: cannot create or reach the hub repo {self.args.hub_model_id!r} "
                f"(train.hub_model_id; needs network access and a token with write access): {first_line(err)}"
            ) from None

    def evaluate(self, *args, **kwargs):
        """``Trainer.evaluate``, timed: :attr:`eval_seconds` is what the last evaluation during
        training took (what finishing the run would need for its own, :mod:`cembed.train.stopping`)."""
        started = time.perf_counter()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.eval_seconds = time.perf_counter() - started

    # --- the throughput meter ----------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``; then the step losses are reduced over the ranks and the meter's totals
        closed, on every rank (one gather each), before rank 0 alone saves and evaluates."""
        self._preload_full_checkpoint(resume_from_checkpoint)
        result = super().train(resume_from_checkpoint, *args, **kwargs)
        self._reduce_step_losses()  # here, on every rank: the summary reads them while rank 0 evaluates
        if self.meter is not None:
            self.meter.finish()
        return result

    @property
    def streaming(self) -> bool:
        """Whether the training rows come from a stream (:class:`~cembed.data.batching.stream.StreamingRows`)."""
        return isinstance(self.train_dataset, StreamingRows)

    def get_train_dataloader(self):
        # Built once: its sampler hashes every text, and the recipe reads its length before
        # train() asks for it again.
        if self._train_dataloader is None and self.streaming:
            # Each rank's stream yields its slice of every global batch already: accelerate's
            # preparation would instead dispatch rank 0's batches (or shard them again), so the loader
            # is not prepared; the trainer moves each batch to the device itself.
            workers = min(self.args.dataloader_num_workers, 1)  # one reader: more would each read it all
            self._train_dataloader = StreamingLoader(
                self.train_dataset,
                batch_size=self.args.per_device_train_batch_size,
                collate_fn=self.data_collator,
                num_workers=workers,
                pin_memory=self.args.dataloader_pin_memory,
                prefetch_factor=self.args.dataloader_prefetch_factor if workers else None,
                worker_init_fn=worker_init(),
            )
        if self._train_dataloader is None:
            self._train_dataloader = super().get_train_dataloader()
        return self._train_dataloader

    def _build_dataloader(self, dataset, batch_size, dataset_kind):
        # Pre-tokenized training batches are fetched a batch at a time from the Arrow table (TokenIdRows).
        loader = super()._build_dataloader(dataset, batch_size, dataset_kind)
        # Its workers ignore the stop signals (SIGTERM, SIGUSR1, ...), which a scheduler sends to every process of the job: the
        # main process decides (InterruptCallback) and ends them.
        loader.worker_init_fn = worker_init(loader.worker_init_fn)
        keep = ("batch_sampler", "collate_fn", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
        keep += ("worker_init_fn",)
        if dataset_kind == "train" and isinstance(self.data_collator, TextCollator) and self.source_rows:
            # Text batches name their source, so sentence-transformers' collator picks its prompts.
            rows = SourceNamedRows(dataset, *self.source_rows)
            return DataLoader(rows, **{k: getattr(loader, k) for k in keep})
        if dataset_kind != "train" or not isinstance(self.data_collator, PaddingCollator):
            return loader
        return DataLoader(TokenIdRows(dataset, self.data_collator.roles), **{k: getattr(loader, k) for k in keep})

    def get_batch_samples(self, *args, **kwargs):
        if self.state.max_steps and self.state.global_step >= self.state.max_steps:
            # A resume from the last step's checkpoint (a run stopped during its final save or
            # evaluation): the trainer's loop would train one step past train.max_steps before its
            # end-of-training check; there is nothing left to train, only the run's end to do.
            self.control.should_training_stop = True
            return [], None
        started = time.perf_counter()
        out = super().get_batch_samples(*args, **kwargs)
        if self.meter is not None:
            self.meter.waited(time.perf_counter() - started)
        return out

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            self._flush_step_losses()
            if self.meter is not None:
                # mfu is None without a known device peak: left out of the trainer's logs (trackers want numbers)
                stats = self.meter.snapshot(self.state.global_step)
                logs = {**logs, **{k: v for k, v in stats.items() if v is not None}}
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

    def _reduce_step_losses(self) -> None:
        # The global step's loss: every rank's share (its rows' mean loss) averaged over the ranks, as
        # the trainer's logged loss averages them (transformers' nested_gather(tr_loss).mean()). One
        # all-gather for the steps not reduced yet; a collective, so every rank calls it at the same
        # point (each step's end, the end of training), with as many steps pending.
        self._flush_step_losses()
        steps = sorted(s for s in self._step_losses if s not in self._global_losses)
        if not steps:
            return
        rows = gather_over_ranks([self._step_losses[s] for s in steps])
        for i, step in enumerate(steps):
            self._global_losses[step] = sum(r[i] for r in rows) / len(rows)

    def step_loss(self, step: int) -> float | None:
        """Optimizer step ``step``'s loss as :meth:`step_losses` gives it (None: not trained by this
        process). Reads the pending losses from the device (one sync) and reduces them over the ranks:
        a collective, called on every rank at every step's end (:class:`RunLogCallback`)."""
        self._reduce_step_losses()
        return self._global_losses.get(step)

    def step_losses(self) -> list[tuple[int, float]]:
        """``(step, loss)`` for every optimizer step this process trained: the global step's loss, the
        mean over the ranks of each rank's loss (the sum over its accumulated mini-batches of loss /
        accumulation steps), as the logged loss and ``train.log`` average it; steps skipped for a
        non-finite loss are left out. The same on every rank. Reduced at each step's end and when
        training ends (:meth:`train`), so reading it later issues no collective."""
        self._reduce_step_losses()
        return [(s, v) for s, v in sorted(self._global_losses.items()) if s not in self._skipped_steps]

    # --- non-finite loss: stop naming the step and the last good checkpoint, or skip -----------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if not torch.is_grad_enabled():  # evaluation: no step to skip
            return out
        value = out[0] if return_outputs else out
        finite = bool(torch.isfinite(value.detach()).all())
        # Every rank takes the same decision (a rank-local skip or stop would leave the others
        # waiting in a collective this rank never joins).
        if not max_over_ranks(int(not finite)):
            return out
        step = self.state.global_step + 1
        if self.nonfinite_policy == "skip":
            # The backward still runs (the same collectives on every rank); the optimizer update is
            # dropped by skip_pending_step, just before optimizer.step().
            self._skip_step = True
            self._skipped_steps.add(step)
            return out
        last = latest_complete(self.args.output_dir)
        what = f"loss is {float(value.detach())}" if not finite else "loss is non-finite on another rank"
        raise RunFailed(
            f"{what} at step {step}; training stopped. Last good checkpoint: "
            f"{last or 'none (set train.save_steps to keep checkpoints)'}. Lower optim.learning_rate and "
            "resume with --resume, or set train.nonfinite_loss: skip"
        )

    def skip_pending_step(self) -> bool:
        """Turn the coming optimizer step into a no-op when a micro-batch of it had a non-finite loss
        (``nonfinite_policy: skip``, decided on every rank alike); called just before
        ``optimizer.step()`` (:class:`SkipNonfiniteCallback`). Returns whether the step is skipped.

        The gradients are dropped (``grad = None``): torch's optimizers leave a parameter without a
        gradient untouched (no update, no weight decay, no moment change). Under fp16 the GradScaler
        must have checked the gradients for infs before ``step()`` (else it raises "No inf checks were
        recorded for this optimizer"): the gradient norm/clipping usually has (``unscale_``); if not,
        it is done here, before the gradients are dropped. ``scaler.update()`` then runs as
        after any step (halving the scale if the gradients held infs).
        """
        if not self._skip_step:
            return False
        self._skip_step = False
        self.nonfinite_skipped += 1
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and not _inf_checks_recorded(scaler, self.optimizer):
            self.accelerator.unscale_gradients()
        for param in self.model.parameters():
            param.grad = None
        return True

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        enable_fsdp_on_cpu(self)  # accelerate drops the FSDP plugin on CPU (cembed.distributed.fsdp)
        if self.is_fsdp_enabled:  # a model's last Normalize is no final norm to shard (cembed.distributed.fsdp)
            search_final_norm_in_backbone(self.model)

    def _preload_full_checkpoint(self, checkpoint) -> None:
        # FSDP resuming a full checkpoint (a 1-process or DDP run's): every rank loads it into the
        # model before the trainer shards it (sentence-transformers' loader reads only whole models),
        # so the shards start from its weights; _load_from_checkpoint then has nothing left to load.
        self._preloaded_checkpoint = None
        if checkpoint and self.is_fsdp_enabled and not is_sharded_checkpoint(checkpoint):
            self._load_unsharded(checkpoint)
            self._preloaded_checkpoint = checkpoint

    def _load_from_checkpoint(self, checkpoint_path, *args, **kwargs) -> None:
        # The steps trained before the checkpoint keep their losses in the summary (and its plot).
        self._global_losses.update(read_step_losses(checkpoint_path))
        if self._preloaded_checkpoint == checkpoint_path:
            self._loaded_checkpoint = checkpoint_path
            return
        # A sharded checkpoint on one process (cembed shards only with more than one):
        # torch.distributed.checkpoint reads the shards into the full model.
        if not self.is_fsdp_enabled and is_sharded_checkpoint(checkpoint_path):
            load_sharded_model(self.model, checkpoint_path)
            self._loaded_checkpoint = checkpoint_path
            return
        # FSDP: the checkpoint holds the ranks' shards (torch.distributed.checkpoint), which only
        # transformers' own loader reads; sentence-transformers' expects a full model folder.
        if self.is_fsdp_enabled:
            from transformers import Trainer

            Trainer._load_from_checkpoint(self, checkpoint_path, *args, **kwargs)
            self._loaded_checkpoint = checkpoint_path
            return
        self._load_unsharded(checkpoint_path)
        self._loaded_checkpoint = checkpoint_path

    def _load_unsharded(self, checkpoint_path) -> None:
        # A LoRA checkpoint holds the backbone as the adapter only, beside the other modules' folders
        # (a Dense head): sentence-transformers' loader would rebuild the model from it through
        # transformers' own PEFT integration instead. load_lora_checkpoint restores both.
        if is_lora(self.model):
            load_lora_checkpoint(self.model, checkpoint_path)
        else:
            super()._load_from_checkpoint(checkpoint_path)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        # A checkpoint of the other layout (sharded on one process, full under FSDP): its optimizer
        # state is read with torch.distributed.checkpoint's tools, its LR schedule as it is.
        if checkpoint is None or is_sharded_checkpoint(checkpoint) == self.is_fsdp_enabled:
            return super()._load_optimizer_and_scheduler(checkpoint)
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper: torch's own
        if self.is_fsdp_enabled:
            saved = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
            load_full_optimizer(self.model, optimizer, saved)
        else:
            load_sharded_optimizer(self.model, optimizer, checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_best_model(self) -> None:
        # sentence-transformers logs a failed load and carries on with the last step's weights: record
        # whether the best checkpoint really was loaded (run_summary.json says so only then). Under
        # FSDP the load is a collective (torch.distributed.checkpoint), so all ranks take the same
        # branch: a rank that skipped it would leave the others waiting in it.
        best = self.state.best_model_checkpoint
        present = bool(best) and is_complete(best)
        if self.is_fsdp_enabled:
            present = bool(reduce_over_ranks(int(present), "min"))
        self.best_model_loaded = False
        if not present:
            return
        self._loaded_checkpoint = None
        super()._load_best_model()
        loaded = self._loaded_checkpoint == best
        self.best_model_loaded = bool(reduce_over_ranks(int(loaded), "min")) if self.is_fsdp_enabled else loaded

    def _load_rng_state(self, checkpoint) -> None:
        # A checkpoint of another world size holds no RNG state for some processes (the trainer would
        # go on with whatever state they have) and another split's for the others. Re-seed every
        # process's streams instead (reproducibly; the resume's changes say so: cembed.train.preflight.rng_reseeded).
        if checkpoint is None or holds_rng_states(checkpoint, self.args.world_size):
            return super()._load_rng_state(checkpoint)
        from transformers import set_seed

        set_seed(reseeded(self.args.seed, self.state.global_step, self.args.process_index))

    # --- atomic checkpoints: staged, marked complete, then renamed into place ------------------

    def _get_output_dir(self, trial):
        return self._staging_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import rotate_checkpoints

        started = time.perf_counter()
        run_dir = super()._get_output_dir(trial)
        name = f"checkpoint-{self.state.global_step}"
        staging_root = os.path.join(run_dir, STAGING)
        staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
        if self.args.should_save:
            shutil.rmtree(staged, ignore_errors=True)
        self._staging_root = staging_root
        step_losses = self.step_losses()  # on every rank: reducing the pending steps is a collective
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_root = None
        self.accelerator.wait_for_everyone()
        self.state.best_model_checkpoint = published_best(self.state, staging_root, run_dir)
        if self.args.should_save:
            apply_umask(staged)  # the weights were written through a private 0o600 temporary file
            # the trainer wrote its state with the staging path (or none): a resume reads this one
            self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
            write_step_losses(staged, step_losses)
            mark_complete(staged, self.state.global_step, self.run_record)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staged, final)
            with contextlib.suppress(OSError):  # the now empty staging folder: output_dir keeps no leftover
                os.rmdir(staging_root)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
            )
        self.accelerator.wait_for_everyone()
        self.last_checkpoint = final
        self.save_seconds = time.perf_counter() - started


def published_best(state, staging_root: str, run_dir: str) -> str | None:
    """Where the best checkpoint lives once published, for ``state.best_model_checkpoint``, on every
    rank alike.

    The trainer records the best checkpoint at save time as the folder it was written into (the
    staging folder, renamed right after), and only where that folder is visible to the rank at that
    moment: ranks could disagree (one None, one a path), and then disagree on loading it at the end.
    Here every rank derives it from the trainer's state alone: this step's checkpoint when this step
    is the best so far, else the path recorded before, moved out of ``staging_root`` into ``run_dir``.
    """
    if state.best_global_step and state.best_global_step == state.global_step:
        return str(Path(run_dir) / f"checkpoint-{state.global_step}")
    best = state.best_model_checkpoint
    if best and Path(best).parent == Path(staging_root):
        return str(Path(run_dir) / Path(best).name)
    return best


class StreamingLoader(DataLoader):
    """The training ``DataLoader`` of a stream (:class:`~cembed.data.batching.stream.StreamingRows`, no
    sampler): ``batch_size`` rows per batch, exactly the windowed batches. :meth:`set_epoch`, which the
    trainer calls before each pass, reaches the stream (a new shuffle where it shuffles)."""

    def set_epoch(self, epoch: int) -> None:
        """Start pass ``epoch`` of the stream."""
        self.dataset.set_epoch(epoch)


def _inf_checks_recorded(scaler, optimizer) -> bool:
    # torch.amp.GradScaler records, per optimizer, the inf checks of unscale_(); step() asserts them.
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(inner))
    return bool(state and state.get("found_inf_per_device"))


class SkipNonfiniteCallback(TrainerCallback):
    """Calls :meth:`CembedTrainer.skip_pending_step` before every optimizer step."""

    def __init__(self, trainer: CembedTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.skip_pending_step()


@dataclass
class RunLog:
    """What a run logged: ``(step, loss)`` per logging interval, the last logged loss and LR, wall
    times; and, updated at every optimizer step (for the progress line), that step's loss
    (``step_loss``, the global step's, over all ranks), the LR it used (``step_lr``) and the step clock
    (:class:`~cembed.train.meter.StepClock`: ETA and this process's samples/s)."""

    losses: list[tuple[int, float]] = field(default_factory=list)
    last_loss: float = float("nan")
    last_lr: float = float("nan")
    started: float = 0.0
    ended: float = 0.0
    step_loss: float = float("nan")
    step_lr: float = float("nan")
    clock: StepClock = field(default_factory=StepClock)

    def samples_per_s(self, samples_per_step: int) -> float:
        """Samples trained per second by this process (its steps only: a resumed run does not count
        the checkpoint's), up to its last step; 0.0 before a step ended."""
        return self.clock.samples_per_s(samples_per_step)


def sparse_cache_text(stats: dict, sep: str = ", ") -> str:
    """A sparse model's cache statistics of the meter (``active_dims_*``, ``cache_bytes_per_row``,
    ``dense_fallback_share``) as text, ``""`` without them."""
    if stats.get("cache_bytes_per_row") is None:
        return ""
    query, document = stats.get("active_dims_query"), stats.get("active_dims_document")
    dims = "/".join("-" if v is None else f"{v:.0f}" for v in (query, document))
    return (
        f"{sep}active dims {dims} (query/document){sep}cache {stats['cache_bytes_per_row']:,.0f} B/row"
        f"{sep}dense fallback {100 * (stats.get('dense_fallback_share') or 0):.0f}%"
    )


def interval_label(step: int, since: int | None) -> str:
    """What a logged loss is the mean of, for the line that shows it beside the progress bar's step
    loss: ``" (mean of steps 31-40)"`` when the interval since the last log (step ``since``) holds
    several steps; ``""`` for one step, where it is that step's loss, the bar's (both the global
    step's, over the ranks)."""
    return f" (mean of steps {since + 1}-{step})" if since is not None and step - since > 1 else ""


def progress_line(
    step: int, max_steps: int, log: RunLog, samples_per_step: int, logs: dict, since: int | None = None
) -> str:
    """One logging interval as text: step, loss, LR, samples/s and the meter's statistics (model
    TFLOP/s and MFU when the meter has them). The loss is the trainer's logged one, the mean over the
    steps since the last log (step ``since``), labelled so (:func:`interval_label`) where it is not the
    one step's loss the progress bar shows."""
    meter = ""
    if "data_wait" in logs:
        meter = (
            f"  {logs['tokens_per_s']:.0f} tok/s  data-wait {100 * logs['data_wait']:.1f}%  "
            f"padding {100 * logs['padded_share']:.1f}%"
        )
    if "flops_per_s" in logs:
        meter += f"  {format_flops(logs['flops_per_s'])}"
    if logs.get("mfu") is not None:
        meter += f"  MFU {100 * logs['mfu']:.1f}%"
    if "masked_share" in logs:  # a false-negative filter: share of in-batch candidates left out
        meter += f"  masked {100 * logs['masked_share']:.2f}%"
    meter += sparse_cache_text(logs, "  ")
    return (
        f"step {step}/{max_steps}  loss {log.last_loss:.4f}{interval_label(step, since)}  "
        f"lr {log.last_lr:.3e}  "
        f"{log.samples_per_s(samples_per_step):.1f} samples/s{meter}"
    )


class RunLogCallback(TrainerCallback):
    """Fills a :class:`RunLog`; on the main process also appends each interval's
    :func:`progress_line` to ``log_path`` and hands it to ``on_line`` (the progress display).

    Args:
        step_loss: ``step -> that optimizer step's loss`` (:meth:`CembedTrainer.step_loss`, reduced
            over the ranks), called at every step end on every rank (it may be a collective) for
            :attr:`RunLog.step_loss`; None: not tracked.
        notes: the loss's notes (:attr:`cembed.losses.registry.BuiltLoss.notes`): each line added to it is
            shown and logged like an interval's line, once, at the end of the step that added it.
    """

    def __init__(
        self,
        log: RunLog,
        samples_per_step: int,
        log_path: Path | None = None,
        on_line: Callable[[str], None] | None = None,
        step_loss: Callable[[int], float | None] | None = None,
        notes: list[str] | None = None,
    ) -> None:
        self.log = log
        self.samples_per_step = samples_per_step
        self.log_path = log_path
        self.on_line = on_line
        self.step_loss = step_loss
        self.notes = notes if notes is not None else []
        self._noted = 0  # notes shown so far
        self._lr = float("nan")  # the LR of the step in progress
        self._logged = 0  # the step of the last logged loss (the start step before the first)

    def on_train_begin(self, args, state, control, **kwargs):
        # global_step is the checkpoint's on a resume (the trainer restored its state before this)
        self.log.clock.begin(state.global_step)
        self.log.started = self.log.clock.started
        self._logged = state.global_step
        # A resumed run's log history (restored from the checkpoint) holds the losses logged before it.
        history = getattr(state, "log_history", ())  # (a TrainerState has one; a bare state in a test may not)
        self.log.losses = [(e["step"], float(e["loss"])) for e in history if "loss" in e and "step" in e]

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        # The LR this step uses (read before the scheduler steps), as the trainer logs it.
        if optimizer is not None and getattr(optimizer, "param_groups", None):
            self._lr = float(optimizer.param_groups[0]["lr"])

    def on_step_end(self, args, state, control, **kwargs):
        self.log.clock.step_ended(state.global_step)
        # on every rank: the step's loss is reduced over the ranks (a collective)
        loss = self.step_loss(state.global_step) if self.step_loss is not None else None
        if not state.is_world_process_zero:
            return
        self.log.step_lr = self._lr
        if loss is not None:
            self.log.step_loss = loss
        for line in self.notes[self._noted :]:
            self._emit(line)
        self._noted = len(self.notes)

    def _emit(self, line: str) -> None:
        if self.on_line is not None:
            self.on_line(line)
        if self.log_path is not None:
            append_log(self.log_path, line)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "learning_rate" in logs:
            self.log.last_lr = float(logs["learning_rate"])
        if "loss" not in logs:
            return
        self.log.last_loss = float(logs["loss"])
        self.log.losses.append((state.global_step, self.log.last_loss))
        since, self._logged = self._logged, state.global_step
        if not state.is_world_process_zero:
            return
        self._emit(progress_line(state.global_step, state.max_steps, self.log, self.samples_per_step, logs, since))

    def on_train_end(self, args, state, control, **kwargs):
        self.log.ended = self.log.clock.clock()
