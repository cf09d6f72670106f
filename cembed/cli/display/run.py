"""What ``cembed train`` prints: :class:`RichRunDisplay` (the :class:`cembed.train.recipe.RunDisplay`
the recipe is handed: probe, run header, components, the tokenize and training progress bars, the
per-interval and evaluation lines), the closing lines of a finished run (done, throughput, stream
counts, evaluation before / after) and the lines of a run stopped by a second signal or before training.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.table import Table
from rich.text import Text

from cembed.cli.common import warn
from cembed.cli.display.probe import print_probe
from cembed.files import display_path

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from cembed.config.schema import CembedConfig
    from cembed.model.unpad import Unpadding
    from cembed.plan.resolve import Plan
    from cembed.probe.search import ProbeResult
    from cembed.train.trainer import RunLog


# --- what a run prints while it trains ------------------------------------------------------------


class RichRunDisplay:
    """The :class:`cembed.train.recipe.RunDisplay` of ``cembed train``: everything the recipe shows,
    on a rich console.

    Args:
        console: where to print (a quiet one on ranks other than 0).
        progress: show the progress bar, the per-interval lines above it and the evaluation lines;
            without it only the probe, the run header and the components are printed.
    """

    def __init__(self, console: Console, progress: bool = True) -> None:
        self.console = console
        self.show_progress = progress
        self.bar = None  # the RichProgressCallback of the run, once progress() built it

    def probe_start(self, device: str) -> None:
        """The line printed before ``mini_batch_size: auto`` is probed at the start of training."""
        self.console.print(f"probing mini_batch_size on {device} (batch.mini_batch_size: auto)", highlight=False)

    def probe(self, result: ProbeResult) -> None:
        """The probe's table and recommendation (as ``cembed probe-minibatch`` prints them)."""
        print_probe(self.console, result)

    def run_header(self, cfg: CembedConfig, plan: Plan, warnings: tuple[str, ...] = ()) -> None:
        """See :func:`print_run_header`."""
        print_run_header(self.console, cfg, plan, warnings)

    def components(self, unpadding: Unpadding, distributed: dict | None, warnings: tuple[str, ...] = ()) -> None:
        """See :func:`print_components`."""
        print_components(self.console, unpadding, distributed, warnings)

    def progress(self, log: RunLog, samples_per_step: int) -> TrainerCallback | None:
        """A :class:`RichProgressCallback` reading ``log`` (None without ``progress``)."""
        if not self.show_progress:
            return None
        self.bar = rich_progress_callback_class()(self.console, log, samples_per_step)
        return self.bar

    def log_line(self, line: str) -> None:
        """One interval's line (step, loss, LR, samples/s), printed above the progress bar."""
        if self.bar is not None:
            self.bar.print_line(line)

    def eval_line(self, line: str) -> None:
        """One evaluation's headline metrics (before, during or after training)."""
        if self.show_progress:
            self.console.print(line, highlight=False)

    def resuming(self, checkpoint: str, step: int, max_steps: int) -> None:
        """``resuming from <checkpoint> at step <step> of <max_steps>`` (the bar then starts at ``step``)."""
        self.console.print(f"resuming from {checkpoint} at step {step} of {max_steps}", highlight=False)

    def interrupt(self, signal_name: str, step: int | None, grace_s: float | None = None) -> None:
        """The acknowledgement of a first Ctrl-C (SIGINT) or SIGTERM, printed above the bar at once;
        during the last step (``grace_s`` given) or after it (``step`` None) it says the run is
        finished if that fits in ``train.stop_grace_seconds``."""
        again = "Ctrl-C again" if signal_name == "SIGINT" else f"send {signal_name} again"
        who = "Ctrl-C" if signal_name == "SIGINT" else signal_name
        grace = f"train.stop_grace_seconds ({grace_s:g} s)" if grace_s is not None else ""
        if step is None:
            head = f"{who} after the last step"
            what = (
                f"finishing the run (final model, evaluation, summary) if that fits in {grace}, "
                "else stopping where --resume finishes it"
            )
        elif grace_s is not None:
            head = who
            what = (
                f"finishing step {step} (the last), then the run if that fits in {grace}, "
                "else saving a checkpoint from which --resume finishes it"
            )
        else:
            head, what = who, f"finishing step {step}, then saving a checkpoint"
        self.console.print(f"[yellow]{head}[/]: {what}; {again} to abandon", highlight=False)

    @contextmanager
    def tokenize_progress(self):
        """A transient ``tokenize`` bar (rows done/total, rows/s, elapsed, remaining) while the data
        is pre-tokenized; drawn from the first update (a cache hit draws nothing), only on a terminal
        and not when quiet (other ranks, ``progress=False``)."""
        if not (self.show_progress and self.console.is_terminal and not self.console.quiet):
            yield None
            return
        bar = TokenizeBar(self.console)
        try:
            yield bar.update
        finally:
            bar.stop()

    def close(self) -> None:
        """Stop the progress bar if it is still drawn (a run that ended without the trainer's
        ``on_train_end``: a second Ctrl-C), so the terminal gets its cursor back."""
        if self.bar is not None:
            self.bar.stop()


class TokenizeBar:
    """The pre-tokenization bar of :meth:`RichRunDisplay.tokenize_progress`: started by the first
    :meth:`update` (from the tokenizing thread's watcher), stopped by :meth:`stop`."""

    def __init__(self, console: Console) -> None:
        import time

        self.console = console
        self.progress: Progress | None = None
        self.task = None
        self.started = time.perf_counter()  # rows/s counts from here: the tokenizing starts at once

    def update(self, done: int, total: int) -> None:
        """``done`` of ``total`` rows are tokenized."""
        import time

        from rich.progress import TimeElapsedColumn, TimeRemainingColumn

        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]tokenize"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]} rows/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self.progress.start()
            self.task = self.progress.add_task("tokenize", total=total, rate="-")
        elapsed = time.perf_counter() - self.started
        rate = f"{done / elapsed:,.0f}" if elapsed > 0 and done else "-"
        self.progress.update(self.task, completed=done, rate=rate)

    def stop(self) -> None:
        """Remove the bar (if it was drawn)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class EtaColumn(ProgressColumn):
    """``eta H:MM:SS`` from the run's :class:`~cembed.train.meter.StepClock` (wall time per step,
    smoothed, from the first step on), counting down between steps; ``eta -:--:--`` before it."""

    def __init__(self, log) -> None:
        super().__init__()
        self.log = log

    def render(self, task) -> Text:
        from cembed.train.meter import format_eta

        total = int(task.total or 0)
        return Text(f"eta {format_eta(self.log.clock.eta(total))}", style="progress.remaining")


class RichProgress:
    """Progress bar (step, loss, LR, samples/s, ETA) on the main process, reading the run's
    :class:`~cembed.train.trainer.RunLog`; :meth:`print_line` prints a log line above the bar.

    Loss and LR are each step's (``RunLog.step_loss`` / ``step_lr``), not the last logging
    interval's; samples/s counts this process's steps over its wall time (a resumed run: the steps
    after the checkpoint's), and the bar starts at the step the trainer starts from.

    The trainer's hooks (``on_train_begin``, ``on_step_end``, ``on_log``, ``on_train_end``) without their
    base class: :func:`rich_progress_callback_class` mixes in transformers' ``TrainerCallback``, so that
    importing the CLI does not import transformers (seconds; ``cembed --help`` must stay fast)."""

    def __init__(self, console: Console, log, samples_per_step: int) -> None:
        self.console = console
        self.log = log
        self.samples_per_step = samples_per_step
        self.progress: Progress | None = None
        self.task = None
        self.step = 0  # the last step shown
        self.started = False

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            EtaColumn(self.log),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        self.started = True
        self.step = state.global_step  # a resumed run's bar starts at the checkpoint's step
        self.task = self.progress.add_task("train", total=state.max_steps, completed=self.step, info=self._info())

    def _loss_and_lr(self) -> tuple[float, float]:
        log = self.log
        loss = log.step_loss if log.step_loss == log.step_loss else log.last_loss  # NaN: no step value
        lr = log.step_lr if log.step_lr == log.step_lr else log.last_lr
        return loss, lr

    def _info(self) -> str:
        loss, lr = self._loss_and_lr()
        rate = self.log.samples_per_s(self.samples_per_step)
        loss_text = f"{loss:.4f}" if loss == loss else "-"  # NaN before the first step
        lr_text = f"{lr:.2e}" if lr == lr else "-"
        return f"loss {loss_text}  lr {lr_text}  {rate:.1f} samples/s"

    def _refresh(self, step: int) -> None:
        if self.progress is not None:
            self.step = step
            self.progress.update(self.task, completed=step, info=self._info())

    def on_step_end(self, args, state, control, **kwargs):
        self._refresh(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._refresh(state.global_step)

    def print_line(self, line: str) -> None:
        """Print ``line`` above the bar (ignored before the bar starts or off the main process)."""
        if self.started:
            self.console.print(line, highlight=False)

    def stop(self) -> None:
        """Stop drawing the bar (idempotent)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def on_train_end(self, args, state, control, **kwargs):
        self.stop()


@functools.cache
def rich_progress_callback_class() -> type:
    """``RichProgressCallback``: :class:`RichProgress` as a transformers ``TrainerCallback`` (built on
    first use, so that transformers is imported only by a command that trains)."""
    from transformers import TrainerCallback

    return type("RichProgressCallback", (RichProgress, TrainerCallback), {"__doc__": RichProgress.__doc__})


def print_run_header(console: Console, cfg, plan, warnings: tuple[str, ...] = ()) -> None:
    """The line ``cembed train`` prints before training: device, batch, mini-batch, loss, LR; then the
    plan's warnings and ``warnings`` (the run's findings: data, unplaceable rows, resume changes)."""
    tokens = f" ({plan.mini_batch_num_tokens} tokens)" if plan.mini_batch_num_tokens else ""
    console.print(
        f"device {plan.device}  precision {plan.precision}{' (TF32 on)' if plan.tf32 else ''}  "
        f"batch {plan.samples_per_step} samples/step  mini-batch {plan.mini_batch_size}{tokens}  "
        f"loss {cfg.loss.name}  lr {plan.lr_derivation}",
        highlight=False,
    )
    for w in (*plan.warnings, *warnings):
        warn(console, w)


def print_components(console: Console, unpadding, distributed: dict | None, warnings: tuple[str, ...] = ()) -> None:
    """The attention path the loss runs (a :class:`cembed.model.unpad.Unpadding`), for several
    processes :func:`print_distributed`, then ``warnings`` (what building the components found)."""
    console.print(f"attention: {unpadding.description}", highlight=False)
    if distributed:
        print_distributed(console, distributed)
    for w in warnings:
        warn(console, w)


def print_distributed(console: Console, info: dict) -> None:
    """Processes, backend, gathering and the parameters frozen for DDP (``run_summary['distributed']``)."""
    frozen = info["frozen_unused_parameters"]
    shown = ", ".join(frozen[:4]) + (f" and {len(frozen) - 4} more" if len(frozen) > 4 else "")
    console.print(
        f"distributed: {info['world_size']} processes ({info['backend']}), gather_across_devices="
        f"{str(info['gather_across_devices']).lower()}; "
        + (
            f"froze {len(frozen)} parameters that never receive a gradient ({shown}), "
            if frozen
            else "every parameter receives a gradient, "
        )
        + f"{'FSDP (sharded)' if info.get('strategy') == 'fsdp' else 'DDP'}, unused-parameter detection off",
        highlight=False,
    )


# --- after the run ------------------------------------------------------------------------------


def print_done(console: Console, summary: dict) -> None:
    """The closing lines of a completed run."""
    from cembed.files import format_bytes
    from cembed.train.flops import format_flops

    steps, here = summary["steps"], summary.get("steps_this_run", summary["steps"])
    if here == 0:  # a resume of the last step's checkpoint: only the run's end was left
        console.print(
            f"[green]done[/]: {steps} steps (all trained before; this run saved and evaluated)", highlight=False
        )
    else:
        trained = (
            f"{steps} steps, {summary['samples_seen']} samples"
            if here == steps  # a resumed run: the rate is over the steps this run trained
            else f"{steps} steps ({here} in this run, {summary['samples_this_run']} samples)"
        )
        console.print(
            f"[green]done[/]: {trained} in {summary['wall_time_s']:.1f}s ({summary['samples_per_s']:.1f} samples/s); "
            f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} (first and last logged means)",
            highlight=False,
        )
    stop = summary.get("stop_signal")
    if stop:
        console.print(
            f"{stop['signal']} during {stop['during']}: the run was finished within train.stop_grace_seconds "
            f"({stop['finished_within_s']:g} s)",
            highlight=False,
        )
    t = summary.get("throughput") or {}
    if "flops_per_s" in t:
        mfu = f", MFU {100 * t['mfu']:.1f}%" if t.get("mfu") is not None else " (no device peak: MFU not computed)"
        console.print(
            f"throughput: {t['tokens_per_s']:.0f} tok/s, model {format_flops(t['flops_per_s'])}{mfu}, "
            f"padding {100 * t['padded_share']:.1f}%, data-wait {100 * t['data_wait']:.1f}%",
            highlight=False,
        )
    print_stream_counts(console, summary)
    lora = summary.get("lora")
    if lora:
        share = lora["adapter_parameters"] / lora["total_parameters"]
        saved = "merged into the weights" if lora["merged"] else "saved as the adapter only"
        console.print(
            f"LoRA: adapter {lora['adapter_parameters']:,} parameters ({format_bytes(lora['adapter_bytes'])} fp32) "
            f"vs full {lora['total_parameters']:,} ({format_bytes(lora['full_bytes'])}), {share:.2%}; {saved}",
            highlight=False,
        )
    console.print(f"model and run_summary.json in {display_path(summary['output_dir'])}", highlight=False)


# Above this share of a stream's rows dropped by the window rule, the closing lines warn.
STREAM_DROP_WARN = 0.05


def print_stream_counts(console: Console, summary: dict) -> None:
    """For a run trained from a stream (``data.train.streaming``): one line with the rows it read,
    placed in batches and dropped (the window rule's counts of the global batches, every pass read so
    far; with several processes each reads the whole stream), and a warning when more than :data:`STREAM_DROP_WARN` of them were dropped
    (a file in file order with equal texts close together: sorted files need a shuffle buffer)."""
    for entry in (summary.get("data") or {}).get("sources") or []:
        stream = entry.get("stream")
        if not stream or stream.get("counts") is None:  # a data-loader worker read it: counts not here
            continue
        passes = [*(stream.get("earlier_passes") or []), stream["counts"]]
        read, placed, dropped = (sum(c[k] for c in passes) for k in ("rows_read", "placed", "dropped"))
        share = dropped / read if read else 0.0
        world = stream.get("world_size", 1)
        whose = f" (global batches of {world} processes, each reading the whole stream)" if world > 1 else ""
        console.print(
            f"stream: {read:,} rows read, {placed:,} placed in batches, {dropped:,} dropped ({share:.1%}){whose}",
            highlight=False,
        )
        if share > STREAM_DROP_WARN:
            buffer = stream.get("shuffle_buffer") or 0
            order = (
                "streaming reads the files in order (shuffle_buffer 0), so a file sorted by a key puts rows sharing "
                "a text together: set data.train.streaming.shuffle_buffer (e.g. 100000)"
                if buffer == 0
                else f"raise data.train.streaming.shuffle_buffer (now {buffer:,}; a sorted file needs a large one)"
            )
            warn(
                console,
                f"{share:.1%} of the stream's rows were dropped (no batch within data.train.streaming.window_batches "
                f"took them without repeating a text); {order}, or raise window_batches",
            )


# Metrics compared before / after training, per set: retrieval NDCG@10 and Recall@10 (keyed by the model
# kind's similarity: <set>_cosine_ndcg@10, <set>_maxsim_ndcg@10), STS Spearman.
COMPARED_METRICS = ("_ndcg@10", "_recall@10", "_spearman_cosine")


def eval_change_rows(block: dict | None) -> list[tuple[str, float | None, float | None, float | None]]:
    """``(metric, before, after, after - before)`` for each set's NDCG@10 and Recall@10 (retrieval)
    and cosine Spearman (STS) in a run summary's ``eval`` block; a value not measured (no "before"
    on a resumed run) is None, and so is its change."""
    before, after = (block or {}).get("before") or {}, (block or {}).get("after") or {}
    keys = [k for k in dict.fromkeys([*before, *after]) if k.endswith(COMPARED_METRICS)]

    def set_and_metric(key: str) -> tuple[str, int]:
        i = next(i for i, m in enumerate(COMPARED_METRICS) if key.endswith(m))
        return key[: -len(COMPARED_METRICS[i])], i

    sets = list(dict.fromkeys(set_and_metric(k)[0] for k in keys))
    order = {k: (sets.index(set_and_metric(k)[0]), set_and_metric(k)[1]) for k in keys}
    rows = []
    for key in sorted(keys, key=order.__getitem__):  # per set: NDCG@10, Recall@10, Spearman
        b, a = before.get(key), after.get(key)
        rows.append((key, b, a, a - b if a is not None and b is not None else None))
    return rows


def print_eval_change(console: Console, summary: dict) -> None:
    """The evaluation before and after training side by side (metric, before, after, change);
    prints nothing for a run without an ``eval`` section."""
    rows = eval_change_rows(summary.get("eval"))
    if not rows:
        return
    table = Table("metric", "before", "after", "change", title="evaluation before / after training")

    def fmt(value: float | None, sign: str = "") -> str:
        return "-" if value is None else f"{value:{sign}.4f}"

    for key, b, a, change in rows:
        style = "" if change is None or change == 0 else ("green" if change > 0 else "red")
        table.add_row(key, fmt(b), fmt(a), f"[{style}]{fmt(change, '+')}[/]" if style else fmt(change, "+"))
    console.print(table)


def abandoned_message(
    signal_name: str, what: str | None, output_dir: str | None, config: Path, overrides: list[str] | None
) -> str:
    """The line of a run abandoned by a second signal, in every mode (one process, the launcher of
    several): ``what`` was abandoned (``step 4``, ``the evaluation``; None: not known, e.g. no rank
    recorded it), not saved; then how to resume from the last complete checkpoint, or that there is none."""
    who = "Ctrl-C" if signal_name == "SIGINT" else signal_name
    return f"[yellow]abandoned {what or 'the step'}[/] ({who} again): not saved; " + _resume_from_last(
        output_dir, config, overrides
    )


def interrupted_before_training(output_dir: str | None, config: Path, overrides: list[str] | None) -> str:
    """The line of a run stopped by Ctrl-C before training started (no handler saves anything yet)."""
    return "[yellow]interrupted[/] before training started; " + _resume_from_last(output_dir, config, overrides)


def _resume_from_last(output_dir: str | None, config: Path, overrides: list[str] | None) -> str:
    from cembed.train.checkpoint import latest_complete

    last = latest_complete(output_dir) if output_dir else None
    if last is None:
        return "no checkpoint to resume from"
    extra = " ".join(overrides or [])
    return (
        f"the last complete checkpoint is {display_path(last)}\n"
        f"resume with: cembed train {config}{' ' + extra if extra else ''} --resume"
    )
