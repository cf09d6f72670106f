"""The commands that check a run before it starts, each with its options, body and rendering:
``cembed validate`` (config, data, plan, truncation), ``cembed inspect-data`` (duplicates and batching)
and ``cembed probe-minibatch`` (the largest ``mini_batch_size`` that fits). Registered by
:mod:`cembed.cli.app`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.table import Table

from cembed.cli.common import ConfigArg, OverridesArg, console, load, note, print_plan, warn, world_size_from_flags
from cembed.errors import UserError

if TYPE_CHECKING:
    from cembed.config.schema import ModelConfig
    from cembed.probe.search import ProbeResult


def validate_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", help="Check for this many processes per node."
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="Check for this many nodes."),
) -> None:
    """Check config, data files and columns without training (no GPU needed).

    A hub dataset that cannot be reached (offline) is reported as a warning; the rest is checked."""
    from cembed.data.placement import check_sampler_batches, sampler_hashes, unplaceable_warnings
    from cembed.train.recipe import check_run_inputs

    cfg = load(config, overrides)
    plan, data = check_run_inputs(cfg, world_size_from_flags(nproc_per_node, nnodes), allow_unloaded=True)
    truncation = _truncation(cfg.model, data, cfg.data.prompts, cfg.batch.unpad, plan.precision)
    hashes = None
    if cfg.sampler.no_duplicates and hasattr(data, "dataset"):
        # Duplicates and batchability judged as the training sampler will judge them (token ids when
        # training pre-tokenizes), so what validate passes, train does not refuse.
        model_cfg = cfg.model if not isinstance(truncation, Exception) else None
        if model_cfg is not None:
            hashes, compared = sampler_hashes(data, model_cfg, cfg.data)
            check_sampler_batches(plan, data, cfg.batch.drop_last, cfg.train.seed, hashes, compared)
    unplaced = unplaceable_warnings(plan, data, cfg.batch.drop_last, cfg.train.seed, hashes)
    found = (*getattr(data, "warnings", ()), *unplaced)
    pooling = None if isinstance(truncation, Exception) else truncation.pooling
    print_validation(console, cfg, plan, data, pooling, found)
    print_truncation(console, truncation)
    console.print("[green]config OK[/]")


def _truncation(model_cfg, data, prompts_cfg=None, unpad="auto", precision=None):
    """A ``ModelTruncation``, or the UserError of a model that cannot be loaded: validate and
    probe-minibatch must not need the model, so that only skips the report. A model cembed refuses
    (ModelRefused: remote code without the option, a kind it cannot train) fails the command.
    ``precision``: the run's resolved precision (the dtypes' autocast)."""
    from cembed.data.prepare import model_truncation_report
    from cembed.errors import ModelRefused

    try:
        return model_truncation_report(model_cfg, data, prompts_cfg=prompts_cfg, unpad=unpad, precision=precision)
    except ModelRefused:
        raise
    except UserError as err:
        return err


def inspect_data_cmd(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Report duplicates in the training data and how the no-duplicates sampler will batch it."""
    from cembed.data.placement import inspect_data
    from cembed.data.prepare import prepare_data
    from cembed.plan.resolve import resolve_plan

    cfg = load(config, overrides)
    plan = resolve_plan(cfg)
    data = prepare_data(cfg.data)
    batch, drop_last = plan.per_device_train_batch_size * plan.world_size, cfg.batch.drop_last or plan.world_size > 1
    print_data_report(console, inspect_data(data, batch, drop_last, cfg.train.seed, cfg.model, cfg.data))


def probe_minibatch_cmd(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (optional: or give --model etc.)."),
    overrides: OverridesArg = None,
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or name (overrides model.name_or_path)."),
    max_seq_length: Optional[int] = typer.Option(
        None, "--max-seq-length", help="Tokens per text (every text is probed at this length)."
    ),
    precision: Optional[str] = typer.Option(None, "--precision", help="auto | fp32 | bf16 | fp16."),
    device: Optional[str] = typer.Option(None, "--device", help="auto | cpu | cuda: where training would run."),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", help="per_device_train_batch_size (default: the config's)."
    ),
    max_size: int = typer.Option(65536, "--max", help="Largest mini_batch_size to try."),
    margin: float = typer.Option(
        0.10, "--margin", help="Headroom: a size fits if its peak stays under (1 - margin) x memory."
    ),
    max_memory: Optional[str] = typer.Option(
        None, "--max-memory", help="Memory budget, e.g. 8GiB (CPU default: physical memory)."
    ),
    write: bool = typer.Option(
        False, "--write", help="Store batch.mini_batch_size and batch.mini_batch_num_tokens in the config file."
    ),
) -> None:
    """Measure the largest mini_batch_size and token budget whose cached-loss step fits (worst case)."""
    from cembed.config.file import set_yaml_value
    from cembed.config.loss import CachedMNRLLossConfig
    from cembed.config.schema import CembedConfig
    from cembed.files import parse_bytes
    from cembed.plan.resolve import resolve_model
    from cembed.probe.auto import run_probe

    if write and config is None:
        raise UserError("--write: needs a config file to write batch.mini_batch_size into")
    cfg: CembedConfig | None = load(config, overrides) if config is not None else None
    model_cfg = model_config_from_flags(cfg.model if cfg else None, model, max_seq_length, precision, device)
    resolved = resolve_model(model_cfg)  # device and precision auto -> what training would use here
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size: must be at least 1, got {batch_size}")
    batch = batch_size or (cfg.batch.per_device_train_batch_size if cfg else 64)
    n_columns = 2 + len(cfg.data.sources()[0].columns.negatives) if cfg else 2
    budget = parse_bytes(max_memory) if max_memory else None
    if cfg is not None:
        from cembed.data.prepare import prepare_data

        truncation = _truncation(
            model_cfg, prepare_data(cfg.data), cfg.data.prompts, cfg.batch.unpad, resolved.precision
        )
        print_truncation(console, truncation)
    console.print(
        f"probing {model_cfg.name_or_path} (max_seq_length {model_cfg.max_seq_length or 'model default'}, "
        f"{resolved.precision}) with per-device batch {batch}, {n_columns} texts per row, up to {min(max_size, batch)}",
        highlight=False,
    )
    result = run_probe(
        model_cfg,
        cfg.loss if cfg else CachedMNRLLossConfig(),
        batch,
        n_columns,
        model_cfg.device,
        precision=resolved.precision,
        max_size=max_size,
        margin=margin,
        max_memory=budget,
        strategy=cfg.distributed.strategy if cfg else "ddp",
        on_trial=lambda r: console.print(
            f"  tried {f'{r.num_tokens} tokens' if r.num_tokens else r.size}: {'fits' if r.fits else 'does not fit'}",
            highlight=False,
        ),
    )
    print_probe(console, result)
    if write:
        for key, value in (
            ("mini_batch_size", result.recommended),
            ("mini_batch_num_tokens", result.recommended_num_tokens),
        ):
            if value is not None:
                set_yaml_value(config, ("batch", key), value)
                console.print(f"wrote batch.{key}: {value} to {config}", highlight=False)


def model_config_from_flags(
    base: ModelConfig | None, model: str | None, max_seq_length: int | None, precision: str | None, device: str | None
) -> ModelConfig:
    """``base`` (or the defaults) with the command line's model flags applied (``probe-minibatch``);
    ``None`` leaves a field as it is.

    Raises:
        UserError: a flag value the config would reject, naming the flag.
    """
    from pydantic import ValidationError

    from cembed.config.schema import ModelConfig

    fields = base.model_dump() if base is not None else {}
    flags = {
        "name_or_path": ("--model", model),
        "max_seq_length": ("--max-seq-length", max_seq_length),
        "precision": ("--precision", precision),
        "device": ("--device", device),
    }
    for key, (_, value) in flags.items():
        if value is not None:
            fields[key] = value
    try:
        return ModelConfig(**fields)
    except ValidationError as err:
        e = err.errors()[0]
        flag = flags.get(str(e["loc"][0]), (str(e["loc"][0]), None))[0]
        raise UserError(f"{flag}: {e['msg']} (got {e.get('input')!r})") from None


# --- rendering ----------------------------------------------------------------------------------


def print_validation(
    console: Console, cfg, plan, data, pooling: str | None = None, warnings: tuple[str, ...] = ()
) -> None:
    """What ``cembed validate`` found: resolved config, device, pooling, plan, data counts, first row;
    ``warnings``: the findings beside the plan's (see :func:`cembed.cli.common.print_plan`)."""
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
    from cembed.files import format_bytes

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


def print_probe(console: Console, result: ProbeResult) -> None:
    """The probe table, notes, the recommendation with its reason and the override line (also what
    ``cembed train`` prints after probing ``mini_batch_size: auto``)."""
    from cembed.files import format_bytes
    from cembed.probe.auto import override_line

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
