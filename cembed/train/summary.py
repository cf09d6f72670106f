"""``run_summary.json``: the entries every summary has, and what a failed run leaves behind.

A run that stops on an unexpected exception (a library error, a bug) still ends with a summary
whose status is ``failed`` (error type, message, step, last good checkpoint), a ``train.log`` line
and the full traceback in ``output_dir/error_traceback.txt``; the exception reaches the CLI as a
one-line :class:`~cembed.errors.RunFailed` (exit 3).
"""

from __future__ import annotations

import os
import platform
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from cembed.data.batching.rules import counted_batches
from cembed.distributed.launch import restarts_record
from cembed.distributed.peers import collective_timeout_s
from cembed.errors import RunFailed, RunInterrupted, UserError, first_line
from cembed.files import append_log, write_atomic, write_json_atomic
from cembed.train.checkpoint import latest_complete

TRACEBACK_FILE = "error_traceback.txt"


def versions() -> dict[str, str]:
    """Python and the library versions a run used (``not installed`` for a missing one)."""
    out = {"python": platform.python_version()}
    for pkg in ("cembed", "torch", "transformers", "sentence-transformers", "datasets"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def summary_base(cfg, plan, data, parts, run_dir, run, warnings: tuple[str, ...] = ()) -> dict:
    """The entries every ``run_summary.json`` has, whether the run completes, fails or stops.

    Args: the recipe's stages' outputs (CembedConfig, Plan, TrainingData, Components, RunDir, Run),
    and the run's findings beside the plan's warnings (data, unplaceable rows, resume changes): the
    ``plan`` entry's ``warnings`` lists both.
    """
    # The config as run (a record, not a config to use): batch.mini_batch_size: auto shows the plan's size,
    # a batch.global_batch_size run the per-device batch it derives.
    config = plan.config_as_run(cfg)
    streamed = getattr(data, "streamed", None) is not None  # a stream's rows are not counted ahead
    return {
        "config": config,
        "plan": {**plan.to_dict(), "warnings": (*plan.warnings, *warnings)},
        "learning_rate": {"effective": plan.learning_rate, "derivation": plan.lr_derivation},
        "data": {
            "source": data.source,
            "rows_read": None if streamed else data.rows_read,
            "rows_dropped_invalid": None if streamed else data.rows_dropped,
            "rows_trained": None if streamed else len(data.dataset),
            "columns": data.roles,
            "batches_per_epoch": run.batches_per_epoch,
            # A stream's left-out rows are the window rule's dropped ones (sources[].stream.counts), not a count here.
            "rows_unplaced_first_epoch": None if streamed else run.rows_unplaced,
            "sampling": parts.sources.strategy if parts.sources else None,
            "sources": source_summary(data, run.trainer),
        },
        "resumed_from": run_dir.checkpoint,
        "resume_changes": list(run_dir.resume_changes),
        "tokenization": parts.token_info,
        "weights": parts.weights._asdict() if parts.weights else None,
        "attention": parts.loss.unpadding.to_dict(),  # batch.unpad: packed rows or padded mini-batches
        "device": plan.device,
        "precision": {  # model.precision as asked and as run (auto resolved for the device; cembed.plan.precision)
            "requested": cfg.model.precision,
            "resolved": plan.precision,
            "tf32": plan.tf32,
            "reason": plan.precision_reason,
        },
        "distributed": parts.distributed,
        "restarts": restarts_record(run_dir.restarts),  # --max-restarts: each restart's reason and resume point
        "mini_batch_probe": plan.mini_batch_probe,
        "versions": versions(),
        "output_dir": str(run_dir.out),
    }


def samples_seen(trainer, steps: int, samples_per_step: int) -> int:
    """Samples the first ``steps`` optimizer steps trained on: the rows of the batches they took when
    the batching rule counts them (the no-duplicates sampler: partial and short batches counted as
    they are), else ``steps x samples_per_step``."""
    sampler = _sampler(trainer)
    if sampler is None:
        return steps * samples_per_step
    return sampler.rows_trained(steps, trainer.args.gradient_accumulation_steps)


def _sampler(trainer):
    """The trainer's batch sampler when its batching rule counts its batches (:func:`counted_batches`), else None."""
    return counted_batches(trainer.get_train_dataloader().batch_sampler)


def source_summary(data, trainer, steps: int | None = None) -> list[dict]:
    """Per training source (a :class:`cembed.data.rows.TrainingData`'s): name, path, rows read,
    dropped and kept, its file count (``files``: a sharded file source's files; for a prepared source
    the files its preparation read, None if unknown; 1 for one file or a source of another kind), what its folder or glob held but did not read
    (``skipped``, ``"<path> (<why>)"``, only when something was), global batches in the first epoch
    (``batches_per_epoch``, also after later epochs; None without a counted sampler); with ``steps``, also the global batches
    (``batches_trained``; optimizer steps when gradient_accumulation_steps is 1) and rows the first
    ``steps`` optimizer steps trained on."""
    sampler = _sampler(trainer)
    # epoch 0's batches whichever epoch the run ended in (a multi-epoch run has moved past it)
    first = sampler.batch_sources(0) if sampler is not None else None
    trained = sampler.trained_per_source(steps, trainer.args.gradient_accumulation_steps) if sampler and steps else None
    out = []
    for i, src in enumerate(data.sources):
        entry = {"name": src.name, "source": src.label, "rows_read": src.rows_read}
        entry |= {"rows_dropped_invalid": src.rows_dropped, "rows": src.rows, "files": _files(src)}
        if getattr(src, "skipped", ()):  # what its folder or glob held but was not read, and why
            entry["skipped"] = list(src.skipped)
        entry["batches_per_epoch"] = first.count(i) if first is not None else None
        if trained is not None:
            entry["batches_trained"], entry["rows_trained"] = trained[i]
        if getattr(src, "stream", None) is not None:
            entry |= {"rows_read": None, "rows_dropped_invalid": None, "rows": None, "rows_checked": src.rows}
            entry["stream"] = stream_summary(trainer)
        out.append(entry)
    return out


def _files(src) -> int | None:
    """A source's ``files`` entry: for a prepared source the files its preparation read (the manifest's
    ``input_files``; None where the writer did not record it), not its parts; else its shard count, 1
    for one file or a source of another kind."""
    manifest = getattr(src, "manifest", None)
    if manifest is not None:
        return manifest.input_files
    return src.files or 1


def stream_summary(trainer) -> dict:
    """A streamed source's entry (``data.train.streaming``): its window and shuffle buffer, the pass
    (epoch) being read and the window rule's counts
    (:class:`cembed.data.batching.windowed.WindowCounts`: rows read, placed, dropped, deferred, left at the end,
    buffered) of the global batches in that pass, as far as training read it (every rank reads the
    whole stream and counts the same), and the earlier passes' (``earlier_passes``, whole passes,
    oldest first). The counts are None when a data-loader worker reads the stream (they live in that
    process)."""
    from dataclasses import asdict

    source = trainer.train_dataset.batches  # the StreamingSource
    in_worker = trainer.get_train_dataloader().num_workers > 0
    return {
        "window_batches": source.window,
        "shuffle_buffer": source.shuffle_buffer,
        "rank": source.rank,
        "world_size": source.world_size,
        "pass": source.epoch,
        "counts": None if in_worker else asdict(source.counts),
        "earlier_passes": None if in_worker else [asdict(c) for c in source.earlier],
        "counted_by": "a data-loader worker (not reported)" if in_worker else "this process",
    }


def save_traceback(err: BaseException, folder: str | Path) -> Path:
    """Write ``err``'s full traceback to ``folder/error_traceback.txt`` and return the path."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return write_atomic(Path(folder) / TRACEBACK_FILE, lambda f: f.write(text))


def failed_summary(base: dict, err: BaseException, step: int, checkpoint: str | None, tb: Path | None) -> dict:
    """A ``failed`` summary: ``base`` plus the error's type and message, the step and the last good checkpoint."""
    return {
        **base,
        "status": "failed",
        "error": str(err),
        "error_type": type(err).__name__,
        "steps": step,
        "last_good_checkpoint": checkpoint,
        "traceback": str(tb) if tb else None,
    }


def failure_cause(err: BaseException, step: int) -> str:
    """What stopped a run after ``step`` optimizer steps, in one line: a collective that timed out
    named as such (gloo's and NCCL's own wording names a socket or a work item, not the rank that
    never came), anything else as its type and first line."""
    timeout = collective_timeout_s(err)
    if timeout is None:
        return f"run failed at step {step}: {type(err).__name__}: {first_line(err, 200)}"
    rank = os.environ.get("RANK", "0")
    return (
        f"a collective timed out after {timeout:g} s on rank {rank} in step {step + 1}: another rank did not reach "
        "it (hung, crashed, or slower than the timeout); raise distributed.timeout_minutes or check the other "
        "ranks' logs"
    )


@dataclass
class Attempt:
    """What a run has built so far, for the failure record: the summary base and the trainer."""

    base: dict | None = None
    trainer: Any = None


@contextmanager
def failures_recorded(out: Path, is_main: bool, attempt: Attempt):
    """Run a training's stages; turn an unexpected exception into a recorded failure.

    UserError (RunFailed included: the ``train`` stage records it) and RunInterrupted pass through.
    Any other exception: on rank 0 the traceback goes to ``out/error_traceback.txt``, a ``failed:``
    line to ``train.log`` and a failed ``run_summary.json`` (see :func:`failed_summary`).

    Raises:
        RunFailed: one line naming the error type, message, step, last good checkpoint and the
            traceback file, chained to the original exception.
    """
    try:
        yield attempt
    except (UserError, RunInterrupted):
        raise
    except Exception as err:
        step = attempt.trainer.state.global_step if attempt.trainer is not None else 0
        checkpoint = str(latest_complete(out)) if latest_complete(out) else None
        tb = save_traceback(err, out) if is_main else None
        message = (
            f"{failure_cause(err, step)}; last good checkpoint: {checkpoint or 'none'}; "
            f"traceback in {tb or out / TRACEBACK_FILE}"
        )
        if is_main:
            append_log(out / "train.log", f"failed: {message}")
            write_json_atomic(out / "run_summary.json", failed_summary(attempt.base or {}, err, step, checkpoint, tb))
        raise RunFailed(message) from err
