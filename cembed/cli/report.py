"""Everything cembed prints to the terminal, in one place.

Library functions return values (dataclasses, dicts) that tests check; the CLI hands them to the
functions here, which render them with rich. Only this module and :mod:`cembed.cli.app` import rich.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from transformers import TrainerCallback

from cembed.files import format_bytes
from cembed.probe.auto import override_line
from cembed.probe.search import ProbeResult
from cembed.train.flops import format_flops
from cembed.train.summary import eval_change_rows

if TYPE_CHECKING:
    from cembed.eval.score import EvalReport


def make_console(quiet: bool = False) -> Console:
    """A console for cembed's output (``quiet``: prints nothing, for ranks other than 0)."""
    return Console(soft_wrap=True, quiet=quiet)


def warn(console: Console, text: str) -> None:
    """One yellow ``warning:`` line."""
    console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False)  # [..] in text is not markup


def note(console: Console, text: str) -> None:
    """One yellow ``note:`` line."""
    console.print(f"[yellow]note:[/] {escape(text)}", highlight=False)


# --- suggest-lr, validate, the plan -------------------------------------------------------------


def print_suggestion(console: Console, s, base_lr: float, base_bs: int, bs: int) -> None:
    """The ``cembed suggest-lr`` answer: suggestion, both rules and the bracket to try."""
    lo, hi = s.bracket
    console.print(f"suggested learning_rate: [bold]{s.suggested:.3e}[/] ({s.rule} rule)", highlight=False)
    console.print(f"  sqrt rule:   {s.sqrt:.3e} = {base_lr:g} x sqrt({bs}/{base_bs})", highlight=False)
    console.print(f"  linear rule: {s.linear:.3e} = {base_lr:g} x ({bs}/{base_bs})", highlight=False)
    console.print(
        f"  bracket to try: {lo:.3e} .. {hi:.3e} (x0.5, x2; halve/double from the suggestion)", highlight=False
    )


def print_plan(console: Console, plan, warnings: tuple[str, ...] = ()) -> None:
    """World size, effective batch, gathering, the LR derivation, the plan's warnings and ``warnings``
    (what the checks before training found: the data's, the rows the sampler cannot place)."""
    per_node = f" ({plan.world_size} processes)" if plan.world_size > 1 else ""
    console.print(
        f"world size: {plan.world_size}{per_node}   effective batch: {plan.per_device_train_batch_size} per device x "
        f"{plan.world_size} x {plan.gradient_accumulation_steps} accumulation = {plan.samples_per_step} samples per "
        f"optimizer step   gather_across_devices: {str(plan.gather_across_devices).lower()}",
        highlight=False,
    )
    console.print(f"effective learning_rate: {plan.lr_derivation}", highlight=False)
    console.print(f"data-loader workers: {plan.dataloader_workers}", highlight=False)
    for w in (*plan.warnings, *warnings):
        warn(console, w)


def print_validation(
    console: Console, cfg, plan, data, pooling: str | None = None, warnings: tuple[str, ...] = ()
) -> None:
    """What ``cembed validate`` found: resolved config, device, pooling, plan, data counts, first row;
    ``warnings``: the findings beside the plan's (see :func:`print_plan`)."""
    console.print("[bold]resolved config[/]")
    console.print_json(json.dumps(cfg.model_dump(mode="json")))
    console.print(f"device: {plan.device}   precision: {plan.precision_reason or plan.precision}", highlight=False)
    console.print(
        f"pooling: {pooling or cfg.model.pooling + ' (model.pooling; the model was not loaded)'}", highlight=False
    )
    print_plan(console, plan, warnings)
    if not hasattr(data, "dataset"):  # cembed.data.prepare.UnloadedData: the hub could not serve the rows
        warn(console, data.message)
        return
    console.print(
        f"data: {data.rows_read} rows read, {data.rows_dropped} dropped, {len(data.dataset)} to train on; "
        f"columns {data.roles}",
        highlight=False,
    )
    if len(data.sources) > 1:
        console.print(f"sampling: {cfg.data.sampling.resolved_strategy}; every batch holds one source", highlight=False)
    for src in data.sources if len(data.sources) > 1 else []:
        console.print(
            f"  source {src.name}: {src.rows_read} rows read, {src.rows_dropped} dropped, {src.rows} to train on "
            f"({src.label}); columns {src.roles}",
            highlight=False,
        )
    table = Table("role", "first training row")
    for key, value in data.dataset[0].items():
        table.add_row(key, str(value))
    console.print(table)


def print_data_report(console: Console, reports) -> None:
    """The ``cembed inspect-data`` tables (one :class:`cembed.data.placement.DataReport` per training
    source) and, below each, the rows that cannot be placed."""
    for report in reports if isinstance(reports, list) else [reports]:
        _print_one_data_report(console, report)


def _print_one_data_report(console: Console, report) -> None:
    out = Table("", "value", title=report.source, title_justify="left")
    out.add_row("rows", f"{report.rows} ({report.rows_dropped} invalid dropped)")
    for role, (source, distinct) in report.distinct.items():
        out.add_row(f"distinct texts: {role} ({source})", str(distinct))
    b = report.batching
    out.add_row("texts compared as", report.compared_as)
    out.add_row("rows sharing a text with another row", f"{100 * b['colliding_share']:.2f}%")
    out.add_row(
        "largest duplicate-free batch", f"{b['largest_batch']} found (at most {b['largest_batch_upper_bound']})"
    )
    out.add_row(f"batches per epoch at batch {report.batch_size}", str(b["batches_per_epoch"]))
    out.add_row("rows left out per epoch", str(b["rows_unplaced"]))
    console.print(out)
    if report.unplaceable:
        warn(console, str(report.unplaceable))


def print_starter(console: Console, s) -> None:
    """What ``cembed init`` wrote (a :class:`cembed.data.starter.Starter`): data, roles, batch size."""
    console.print(f"wrote {s.out} for {s.model}", highlight=False)
    invalid = f", {s.rows_invalid} with an empty cell (skipped)" if s.rows_invalid else ""
    console.print(f"data: {s.data} ({s.rows} rows{invalid}; columns {', '.join(s.columns)})", highlight=False)
    table = Table("role", "column", "found")
    for role, column in s.roles.items():
        table.add_row(role, column, s.how[role])
    for column in s.negatives:
        table.add_row("negative", column, "by name")
    console.print(table)
    console.print(
        f"per_device_train_batch_size: {s.batch_size} (largest duplicate-free batch found: {s.largest_batch}; "
        f"at least 4 steps per epoch)",
        highlight=False,
    )
    console.print(f"next: cembed validate {s.out}", highlight=False)


# --- a training run ----------------------------------------------------------------------------


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


def print_components(console: Console, unpadding, distributed: dict | None) -> None:
    """The attention path the loss runs (a :class:`cembed.model.unpad.Unpadding`) and, for several
    processes, :func:`print_distributed`."""
    console.print(f"attention: {unpadding.description}", highlight=False)
    if distributed:
        print_distributed(console, distributed)


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


def print_done(console: Console, summary: dict) -> None:
    """The closing lines of a completed run."""
    console.print(
        f"[green]done[/]: {summary['steps']} steps, {summary['samples_seen']} samples in {summary['wall_time_s']:.1f}s "
        f"({summary['samples_per_s']:.1f} samples/s); loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}",
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
    lora = summary.get("lora")
    if lora:
        share = lora["adapter_parameters"] / lora["total_parameters"]
        saved = "merged into the weights" if lora["merged"] else "saved as the adapter only"
        console.print(
            f"LoRA: adapter {lora['adapter_parameters']:,} parameters ({format_bytes(lora['adapter_bytes'])} fp32) "
            f"vs full {lora['total_parameters']:,} ({format_bytes(lora['full_bytes'])}), {share:.2%}; {saved}",
            highlight=False,
        )
    console.print(f"model and run_summary.json in {summary['output_dir']}", highlight=False)


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


class RichProgressCallback(TrainerCallback):
    """Progress bar (step, loss, LR, samples/s, ETA) on the main process, reading the run's
    :class:`~cembed.train.trainer.RunLog`; :meth:`print_line` prints a log line above the bar."""

    def __init__(self, console: Console, log, samples_per_step: int) -> None:
        self.console = console
        self.log = log
        self.samples_per_step = samples_per_step
        self.progress: Progress | None = None
        self.task = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
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

    def _refresh(self, step: int) -> None:
        if self.progress is not None:
            rate = self.log.samples_per_s(step, self.samples_per_step)
            info = f"loss {self.log.last_loss:.4f}  lr {self.log.last_lr:.2e}  {rate:.1f} samples/s"
            self.progress.update(self.task, completed=step, info=info)

    def on_step_end(self, args, state, control, **kwargs):
        self._refresh(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._refresh(state.global_step)

    def print_line(self, line: str) -> None:
        """Print ``line`` above the bar (ignored before the bar starts or off the main process)."""
        if self.progress is not None:
            self.progress.console.print(line, highlight=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.stop()


# --- truncation and the mini-batch probe --------------------------------------------------------


def truncation_table(max_seq_length: int, report: list) -> Table:
    """A table of :func:`cembed.data.prepare.truncation_report` (``ColumnTruncation`` rows)."""
    rows = report[0].rows if report else 0
    table = Table(
        "column",
        "rows > max_seq_length",
        "fraction",
        "longest (tokens)",
        title=f"truncation at max_seq_length {max_seq_length} ({rows} rows checked)",
    )
    for c in report:
        name = c.column if c.column == c.source else f"{c.column} ({c.source})"
        table.add_row(name, str(c.truncated), f"{100 * c.fraction:.1f}%", str(c.max_tokens))
    return table


def print_truncation(console: Console, truncation) -> None:
    """The weights' dtypes and the truncation table, or why it was skipped (``truncation`` is a
    :class:`cembed.data.prepare.ModelTruncation` or the :class:`~cembed.errors.UserError` that kept the model
    from loading)."""
    if isinstance(truncation, Exception):
        console.print(f"[yellow]truncation report skipped:[/] {truncation}", highlight=False)
        return
    if truncation.weights is not None:
        console.print(truncation.weights.describe(), highlight=False)
    if truncation.prompts is not None:
        console.print(describe_prompts(truncation.prompts), highlight=False)
    if truncation.attention is not None:
        console.print(f"attention: {truncation.attention.description}", highlight=False)
    if not truncation.columns:
        console.print(
            f"model loads; max_seq_length {truncation.max_seq_length}; truncation unchecked (no rows)", highlight=False
        )
        return
    console.print(truncation_table(truncation.max_seq_length, truncation.columns))


def describe_prompts(prompts) -> str:
    """One line: each role's prompt (a :class:`cembed.model.prompts.RolePrompts`) and where it came from."""
    roles = prompts.to_dict()
    return "prompts: " + "; ".join(f"{r} {v['prompt']!r} ({v['from']})" for r, v in roles.items())


def probe_table(result: ProbeResult) -> Table:
    """Size (rows, or a token budget and the rows it cut), peak memory, % of the limit, samples/s,
    fits (in trial order); ``*`` marks the pick."""
    table = Table(
        "mini-batch",
        "peak memory",
        "of limit",
        "samples/s",
        "fits",
        title=(
            f"probe on {result.device or '?'}: limit {format_bytes(result.limit_bytes)} = "
            f"(1 - {result.margin:g}) x {format_bytes(result.capacity_bytes)}"
        ),
    )
    for r in result.trials:
        pct = f"{100 * r.peak_bytes / result.limit_bytes:.0f}%" if r.peak_bytes and result.limit_bytes else "-"
        peak = format_bytes(r.peak_bytes) if r.peak_bytes else "-"
        if r.error and r.error.startswith("over budget") and r.peak_bytes:
            peak = ">" + peak
        sps = f"{r.samples_per_s:.1f}" if r.samples_per_s else "-"
        fits = "[green]yes[/]" if r.fits else f"[red]no[/] ({r.error or 'over the limit'})"
        mark = " *" if r.size == result.recommended else ""
        size = f"{r.num_tokens} tokens ({r.size} rows)" if r.num_tokens else f"{r.size} rows"
        table.add_row(f"{size}{mark}", peak, pct, sps, fits)
    return table


def print_probe_start(console: Console, device: str) -> None:
    """The line printed before ``mini_batch_size: auto`` is probed at the start of training."""
    console.print(f"probing mini_batch_size on {device} (batch.mini_batch_size: auto)", highlight=False)


def print_probe(console: Console, result: ProbeResult) -> None:
    """The probe table, notes, the recommendation with its reason and the override line."""
    console.print(probe_table(result))
    for text in result.notes:
        note(console, text)
    if len(result.ranks) > 1:  # each rank's own answer and peak (the job uses the minimum)
        peaks = ", ".join(
            f"rank {r['rank']} {r['recommended']} at {format_bytes(r['peak_bytes'])}" for r in result.ranks
        )
        note(console, f"per rank (size found, peak): {peaks}; limit {format_bytes(result.limit_bytes)}")
    if result.world_size > 1:
        note(console, f"the loss stage was measured over the gathered candidates of {result.world_size} ranks")
    console.print(f"recommended mini_batch_size: [bold]{result.recommended}[/] ({result.reason})", highlight=False)
    if result.recommended_num_tokens is not None:
        console.print(
            f"recommended mini_batch_num_tokens: [bold]{result.recommended_num_tokens}[/] (= {result.recommended} rows "
            f"x {result.tokens_per_row} tokens; largest that fits: {result.max_fit_num_tokens} = {result.max_fit} x "
            f"{result.tokens_per_row}); shorter rows then share a mini-batch in larger numbers",
            highlight=False,
        )
    console.print(f"override: {override_line(result)}", highlight=False)


# --- cembed eval ---------------------------------------------------------------------------------


def encode_progress(console: Console):
    """A ``progress`` factory for :func:`cembed.eval.score.score_model`: for each retrieval set, a
    transient rich bar ``encode <set> corpus`` (done/total documents, elapsed, remaining)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    @contextmanager
    def bar(name: str, total: int):
        with Progress(
            TextColumn(f"[bold]encode {name} corpus"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        ) as p:
            task = p.add_task("encode", total=total)
            yield lambda done, _total: p.update(task, completed=done)

    return bar


def print_eval_report(console: Console, report: EvalReport) -> None:
    """The ``cembed eval`` table (set, size, headline metrics, where the corpus embeddings came from)
    and, when the report was written as JSON, where to."""
    table = Table(
        "set", "size", "metric", "value", title=f"{report.model}  (fingerprint {report.model_fingerprint[:12]})"
    )
    for name, entry in report.sets.items():
        size = (
            f"{entry['queries']} q / {entry['documents']} docs"
            if entry["kind"] == "retrieval"
            else f"{entry['pairs']} pairs"
        )
        for i, (label, value) in enumerate(entry["headline"].items()):
            table.add_row(name if i == 0 else "", size if i == 0 else "", label, f"{value:.5f}")
        if entry["kind"] == "retrieval":
            how = "from cache" if entry["corpus_cache_hit"] else f"encoded in {entry['encode_seconds']:.1f}s"
            table.add_row("", "", "corpus", how)
    console.print(table)
    if report.json_out is not None:
        console.print(f"metrics written to {report.json_out}", highlight=False)


def print_mining_report(console: Console, report) -> None:
    """``cembed mine-negatives``' result: :meth:`cembed.data.mining.MiningReport.lines`, as plain text."""
    for line in report.lines():
        console.print(line, highlight=False, markup=False)


def print_dims_report(console: Console, report) -> None:
    """The ``cembed eval --dims`` table: one row per set and metric, one column per embedding size."""
    dims = list(report.scores)
    table = Table("set", "metric", *map(str, dims), title=f"{report.model}  (embedding sizes; full {report.full_dim})")
    for name, head in report.scores[dims[0]].items():
        for i, label in enumerate(head):
            table.add_row(name if i == 0 else "", label, *(f"{report.scores[d][name][label]:.5f}" for d in dims))
    console.print(table)
    if report.json_out is not None:
        console.print(f"metrics written to {report.json_out}", highlight=False)
