"""The commands that check a run before it starts, each with its options, body and rendering:
``cembed validate`` (config, data, plan, truncation), ``cembed inspect-data`` (duplicates and batching)
and ``cembed probe-minibatch`` (the largest ``mini_batch_size`` that fits). Registered by
:mod:`cembed.cli.app`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cembed.cli.common import (
    ConfigArg,
    Device,
    OverridesArg,
    Precision,
    console,
    examples,
    flag,
    load,
    note,
    warn,
    world_size_from_flags,
)
from cembed.errors import UserError
from cembed.files import display_path

if TYPE_CHECKING:
    from cembed.config.schema import ModelConfig
    from cembed.probe.search import ProbeResult

VALIDATE_EXAMPLES = examples(
    "cembed validate quickstart.yaml",
    "cembed validate quickstart.yaml batch.per_device_train_batch_size=256 --verbose",
    "cembed validate quickstart.yaml --nproc-per-node 4",
    "cembed validate quickstart.yaml --json | jq .steps",
)
INSPECT_DATA_EXAMPLES = examples(
    "cembed inspect-data quickstart.yaml",
    "cembed inspect-data quickstart.yaml batch.per_device_train_batch_size=1024",
)
PROBE_MINIBATCH_EXAMPLES = examples(
    "cembed probe-minibatch quickstart.yaml --write",
    "cembed probe-minibatch --model all-MiniLM-L6-v2 --max-seq-length 128 --device cpu --max-memory 3GiB",
    "cembed probe-minibatch --model all-MiniLM-L6-v2 --max-seq-length 256 --precision bf16 --device cuda --batch-size 65536",
)


def validate_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", help="Check for this many processes per node."
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="Check for this many nodes."),
    verbose: bool = flag(
        False,
        "--verbose/--no-verbose",
        "-v",
        help="After the summary, also print the full resolved config and the tables.",
    ),
    as_json: bool = flag(
        False,
        "--json/--no-json",
        help="Print only one JSON object: the summary's facts, the plan and the resolved config.",
    ),
) -> None:
    """Check config, data files and columns without training (no GPU needed); print a short summary.

    Refuses what train refuses: a model that cannot be loaded, a batch the sampler never fills.
    A hub dataset that cannot be reached (offline) is reported as a warning; the rest is checked."""
    cfg = load(config, overrides)  # a config mistake answers before the data libraries are imported
    from transformers.utils import logging as transformers_logging

    from cembed.data.batching.placement import check_sampler_batches, sampler_hashes, unplaceable_warnings
    from cembed.data.truncation import model_truncation_report
    from cembed.model.load import load_model, quiet_libraries
    from cembed.train.recipe import check_run_inputs

    # The summary is validate's output: transformers' "Loading weights" bars (on or off depending on
    # which library was imported first) would open it with noise.
    transformers_logging.disable_progress_bar()
    plan, data = check_run_inputs(cfg, world_size_from_flags(nproc_per_node, nnodes), allow_unloaded=True)
    # Loaded once, for the report and the sampler's hashes; train loads it first too, so a model it
    # cannot load is refused here with train's own error.
    quiet_libraries()
    model = load_model(cfg.model, "cpu")
    truncation = model_truncation_report(
        cfg.model, data, prompts_cfg=cfg.data.prompts, unpad=cfg.batch.unpad, precision=plan.precision, model=model
    )
    streamed = getattr(data, "streamed", None) is not None
    if streamed and not isinstance(truncation, Exception) and truncation.prompts is not None:
        from cembed.data.batching.stream import check_stream_prompts

        check_stream_prompts(truncation.prompts, data.columns, data.sources[0].key)  # what train refuses
    hashes = None
    # A stream's batches are made as it is read (the window rule): its first rows say nothing of them.
    if cfg.sampler.no_duplicates and hasattr(data, "dataset") and not streamed:
        # Duplicates and batchability judged as the training sampler will judge them (token ids when
        # training pre-tokenizes), so what validate passes, train does not refuse.
        hashes, compared = sampler_hashes(data, cfg.model, cfg.data, model=model)
        check_sampler_batches(plan, data, cfg.batch.drop_last, cfg.train.seed, hashes, compared)
    unplaced = (
        unplaceable_warnings(plan, data, cfg.batch.drop_last, cfg.train.seed, hashes) if hashes is not None else ()
    )
    found = (*getattr(data, "warnings", ()), *unplaced)
    report = validation_report(cfg, plan, data, truncation, found)
    if as_json:  # stdout holds the JSON alone, for `| jq`
        typer.echo(json.dumps(report, indent=2))
        return
    print_validation(console, report)
    if verbose:
        console.print("[bold]resolved config[/]")
        console.print_json(json.dumps(report["config"]))
        if hasattr(data, "dataset"):
            print_first_row(console, data)
        if not isinstance(truncation, Exception) and truncation.columns:
            console.print(truncation_table(truncation.max_seq_length, truncation.columns))
    more = "" if verbose else " (full resolved config: --verbose; machine-readable: --json)"
    console.print(f"[green]config OK[/]{more}", highlight=False)


def _truncation(model_cfg, data, prompts_cfg=None, unpad="auto", precision=None):
    """A ``ModelTruncation``, or the UserError of a model that cannot be loaded (``validate`` raises
    it, as train would refuse the model; ``probe-minibatch`` skips the report). A model cembed refuses
    (ModelRefused: remote code without the option, a kind it cannot train) fails the command.
    ``precision``: the run's resolved precision (the dtypes' autocast)."""
    from cembed.data.truncation import model_truncation_report
    from cembed.errors import ModelRefused

    try:
        return model_truncation_report(model_cfg, data, prompts_cfg=prompts_cfg, unpad=unpad, precision=precision)
    except ModelRefused:
        raise
    except UserError as err:
        return err


def inspect_data_cmd(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Report duplicates in the training data and how the no-duplicates sampler will batch it."""
    cfg = load(config, overrides)  # a config mistake answers before the data libraries are imported
    from cembed.data.inspect import inspect_data
    from cembed.data.load import load_training_data
    from cembed.plan.resolve import resolve_plan

    plan = resolve_plan(cfg)
    data = load_training_data(cfg.data)
    batch, drop_last = plan.per_device_train_batch_size * plan.world_size, cfg.batch.drop_last or plan.world_size > 1
    print_data_report(console, inspect_data(data, batch, drop_last, cfg.train.seed, cfg.model, cfg.data))


def probe_minibatch_cmd(
    config: Optional[Path] = typer.Argument(None, help="YAML config file (optional: or give --model etc.)."),
    overrides: OverridesArg = None,
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or name (overrides model.name_or_path)."),
    max_seq_length: Optional[int] = typer.Option(
        None, "--max-seq-length", help="Tokens per text (every text is probed at this length)."
    ),
    precision: Optional[Precision] = typer.Option(
        None, "--precision", help="Training precision (default: the config's)."
    ),
    device: Optional[Device] = typer.Option(None, "--device", help="Where training would run (default: the config's)."),
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
    write: bool = flag(
        False,
        "--write/--no-write",
        help="Store batch.mini_batch_size and batch.mini_batch_num_tokens in the config file.",
    ),
) -> None:
    """Measure the largest mini_batch_size and token budget whose cached-loss step fits (worst case)."""
    if write and config is None:
        raise UserError("--write: needs a config file to write batch.mini_batch_size into")
    cfg = load(config, overrides) if config is not None else None  # config mistakes answer first
    from cembed.config.file import set_yaml_value
    from cembed.config.loss import CachedMNRLLossConfig
    from cembed.files import parse_bytes
    from cembed.plan.resolve import resolve_model
    from cembed.probe.auto import run_probe

    model_cfg = model_config_from_flags(cfg.model if cfg else None, model, max_seq_length, precision, device)
    resolved = resolve_model(model_cfg)  # device and precision auto -> what training would use here
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size: must be at least 1, got {batch_size}")
    batch = batch_size or (cfg.batch.per_device_train_batch_size if cfg else 64)
    n_columns = cfg.data.max_columns() if cfg else 2  # the widest source: the worst case of a step
    budget = parse_bytes(max_memory) if max_memory else None
    if cfg is not None:
        from cembed.data.load import load_training_data

        truncation = _truncation(
            model_cfg, load_training_data(cfg.data), cfg.data.prompts, cfg.batch.unpad, resolved.precision
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


def _source_shown(source: dict) -> str:
    """A source of the report as the summary names it: its path, with its file count when sharded."""
    files = source.get("files")
    return display_path(source["path"]) + (f" ({files} files)" if files else "")


def _skipped_line(source: dict, shown: int = 8) -> str:
    """What a source's folder or glob held but was not read, and why, on one line (the first
    ``shown``; ``--json`` lists them all)."""
    skipped = source["skipped"]
    more = f", and {len(skipped) - shown} more (--json lists them)" if len(skipped) > shown else ""
    return f"not read in {display_path(source['path'])}: {', '.join(skipped[:shown])}{more}"


def _batches(rows: int, batch: int, drop_last: bool) -> int:
    return rows // batch if drop_last else -(-rows // batch)


def validation_report(cfg, plan, data, truncation, warnings: tuple[str, ...] = ()) -> dict:
    """What ``cembed validate`` found, as JSON-ready values (``--json`` prints it, the summary renders it).

    Args:
        cfg: the loaded config; plan: its :class:`cembed.plan.resolve.Plan`.
        data: a :class:`cembed.data.rows.TrainingData`, or ``UnloadedData`` (hub offline).
        truncation: a :class:`cembed.data.truncation.ModelTruncation`, or the UserError that kept the
            model from loading (then ``model.load_error`` holds it and the model's facts are None).
        warnings: the findings beside the plan's own warnings (data, unplaceable rows).

    Returns:
        ``{model, loss, data, batch, learning_rate, steps, device, truncation, warnings, plan,
        config}``. ``data.batches_per_epoch`` counts global batches from the rows (``rows / batch``,
        a short last batch counted unless ``drop_last``, per source, in the sampling schedule); the
        no-duplicates sampler can build fewer, and then a warning says how many. ``steps.total`` is
        ``train.max_steps``, else epochs x ``ceil(batches / accumulation)``; None when the rows are
        unknown (unloaded hub data).
    """
    from cembed.data.batching.mixture import SourceMix

    loaded = hasattr(data, "dataset")
    model_ok = not isinstance(truncation, Exception)
    batch = plan.per_device_train_batch_size * plan.world_size
    drop = cfg.batch.drop_last or plan.world_size > 1
    if loaded:
        roles = dict(data.roles)
        sources = [
            {
                "name": s.name,
                "path": s.label,
                "files": s.files,
                "skipped": list(s.skipped),
                "rows_read": s.rows_read,
                "rows_dropped": s.rows_dropped,
                "rows": s.rows,
                "columns": s.roles,
                "batches_per_epoch": _batches(s.rows, batch, drop),
            }
            for s in data.sources
        ]
        per_source = [s["batches_per_epoch"] for s in sources] or [_batches(len(data.dataset), batch, drop)]
        batches = len(SourceMix.from_data(data, cfg.data.sampling).schedule(per_source))
        first = data.first_row()
        stream = data.streamed
        if stream is not None:  # only the first rows were read: nothing is counted
            batches = sources[0]["batches_per_epoch"] = None
            sources[0] |= {"rows_read": None, "rows_dropped": None, "rows": None, "rows_checked": data.rows_read}
        data_facts = {
            "loaded": True,
            "streaming": stream.model_dump() if stream is not None else None,
            "rows_read": None if stream else data.rows_read,
            "rows_dropped": None if stream else data.rows_dropped,
            "rows": None if stream else len(data.dataset),
            "batches_per_epoch": batches,
            "sampling": cfg.data.sampling.resolved_strategy if len(sources) > 1 else None,
            "sources": sources,
            "first_row": first,
        }
    else:
        columns = cfg.data.sources()[0].columns
        roles = {"anchor": columns.anchor, "positive": columns.positive}
        roles |= {f"negative_{i + 1}": n for i, n in enumerate(columns.negatives)}
        batches = None
        data_facts = {"loaded": False, "source": data.source, "reason": data.reason, "batches_per_epoch": None}
    accumulation = plan.gradient_accumulation_steps
    per_epoch = max(1, -(-batches // accumulation)) if batches else None
    if cfg.train.max_steps:
        total, length = cfg.train.max_steps, "train.max_steps"
    else:
        epochs = cfg.train.num_train_epochs
        total = math.ceil(epochs * per_epoch) if per_epoch else None
        length = f"train.num_train_epochs: {epochs:g}"
    warmup = math.ceil(total * cfg.optim.warmup_ratio) if total is not None else None
    trunc = None
    if model_ok:
        trunc = {
            "max_seq_length": truncation.max_seq_length,
            "rows_checked": truncation.columns[0].rows if truncation.columns else 0,
            "stored_ids": truncation.stored_ids,
            "columns": [
                {"column": c.column, "source": c.source, "truncated": c.truncated, "max_tokens": c.max_tokens}
                for c in truncation.columns
            ],
        }
    weights = truncation.weights if model_ok else None
    return {
        "model": {
            "name_or_path": cfg.model.name_or_path,
            "max_seq_length": truncation.max_seq_length if model_ok else cfg.model.max_seq_length,
            "pooling": truncation.pooling
            if model_ok
            else f"{cfg.model.pooling} (model.pooling; the model was not loaded)",
            "weights": weights._asdict() if weights is not None else None,
            "weights_line": weights.describe() if weights is not None else None,
            "prompts": truncation.prompts.to_dict() if model_ok and truncation.prompts is not None else None,
            "attention": truncation.attention.description if model_ok and truncation.attention is not None else None,
            "load_error": None if model_ok else str(truncation),
        },
        "loss": {"name": cfg.loss.name, "columns": roles},
        "data": data_facts,
        "batch": {
            "per_device_train_batch_size": plan.per_device_train_batch_size,
            "world_size": plan.world_size,
            "gradient_accumulation_steps": accumulation,
            "samples_per_step": plan.samples_per_step,
            "mini_batch_size": plan.mini_batch_size if plan.mini_batch_size is not None else "auto",
            "mini_batch_num_tokens": plan.mini_batch_num_tokens,
            "gather_across_devices": plan.gather_across_devices,
            "drop_last": drop,
        },
        "learning_rate": {"effective": plan.learning_rate, "derivation": plan.lr_derivation},
        "steps": {"total": total, "from": length, "per_epoch": per_epoch, "warmup": warmup},
        "device": {
            "device": plan.device,
            "precision": plan.precision,
            "precision_reason": plan.precision_reason or plan.precision,
            "dataloader_workers": plan.dataloader_workers,
        },
        "truncation": trunc,
        "warnings": [*plan.warnings, *warnings, *([] if loaded else [data.message])],
        "plan": plan.to_dict(),
        "config": cfg.model_dump(mode="json"),
    }


def _short(text: str, width: int = 60) -> str:
    return repr(text if len(text) <= width else text[: width - 3] + "...")


def print_validation(console: Console, report: dict) -> None:
    """The summary of :func:`validation_report`, about a dozen lines: what will train (model, loss,
    columns), on what (sources, rows, first row, batches per epoch), how big and how fast (batch,
    mini-batch, effective LR, steps), the model's checks (device and precision, dtypes, prompts,
    attention path, truncation) and the warnings; with several sources one more line per source.
    (``validate --verbose`` adds the resolved config and the tables after it.)"""
    m, d, b, st, dev = report["model"], report["data"], report["batch"], report["steps"], report["device"]
    p = lambda text: console.print(text, highlight=False)  # noqa: E731
    length = f"max_seq_length {m['max_seq_length']}" if m["max_seq_length"] else "model's max_seq_length"
    p(f"model: {m['name_or_path']} ({length})   pooling: {m['pooling']}")
    cols = ", ".join(role if role == src else f"{role} <- {src}" for role, src in report["loss"]["columns"].items())
    p(f"loss: {report['loss']['name']} on {cols}")
    if d["loaded"]:
        sources = d["sources"]
        what = _source_shown(sources[0]) if len(sources) == 1 else f"{len(sources)} sources"
        per_epoch = (
            f"{d['batches_per_epoch']} batches of {b['per_device_train_batch_size'] * b['world_size']} per epoch"
        )
        if d.get("streaming"):
            w = d["streaming"]
            p(
                f"data: {what}: a stream (rows not counted); its first {sources[0]['rows_checked']} rows checked "
                f"(columns, cells); no-duplicate batches over a window of {w['window_batches']} batches, "
                f"shuffle buffer {w['shuffle_buffer'] or 'none (file order)'}"
            )
        else:
            p(
                f"data: {what}: {d['rows_read']} rows read, {d['rows_dropped']} dropped, {d['rows']} to train on; "
                f"{per_epoch}"
                + (f" (sampling: {d['sampling']}; every batch holds one source)" if d["sampling"] else "")
            )
        for s in sources if len(sources) > 1 else []:
            p(
                f"  source {s['name']}: {s['rows_read']} rows read, {s['rows_dropped']} dropped, {s['rows']} to train "
                f"on ({_source_shown(s)}); {s['batches_per_epoch']} batches; columns {s['columns']}"
            )
        for s in sources:
            if s.get("skipped"):
                p(f"  {_skipped_line(s)}")
        if d["first_row"]:
            p("  first row: " + " | ".join(f"{k} {_short(v)}" for k, v in d["first_row"].items()))
    else:
        p(f"data: {d['source']} (not loaded: see the warning below)")
    mini = f"mini_batch_size: {b['mini_batch_size']}"
    if b["mini_batch_size"] == "auto":
        mini += " (probed when train starts)"
    if b["mini_batch_num_tokens"]:
        mini += f", mini_batch_num_tokens: {b['mini_batch_num_tokens']}"
    processes = f" ({b['world_size']} processes)" if b["world_size"] > 1 else ""
    p(
        f"batch: world size: {b['world_size']}{processes}   effective batch: {b['per_device_train_batch_size']} per "
        f"device x {b['world_size']} x {b['gradient_accumulation_steps']} accumulation = {b['samples_per_step']} "
        f"samples per optimizer step   {mini}   gather_across_devices: {str(b['gather_across_devices']).lower()}"
    )
    p(f"effective learning_rate: {report['learning_rate']['derivation']}")
    if st["total"] is not None:
        epoch = f"; an epoch is {st['per_epoch']} steps" if st["per_epoch"] else ""
        p(f"steps: {st['total']} optimizer steps ({st['from']}), {st['warmup']} of them warmup{epoch}")
    else:
        p(f"steps: unknown until the data is loaded ({st['from']})")
    p(
        f"device: {dev['device']}   precision: {dev['precision_reason']}   data-loader workers: {dev['dataloader_workers']}"
    )
    if m["load_error"] is not None:
        console.print(f"[yellow]truncation report skipped:[/] {escape(m['load_error'])}", highlight=False)
    else:
        for line in (m["weights_line"], _prompts_line(m["prompts"]), m["attention"] and f"attention: {m['attention']}"):
            if line:
                p(line)
        p(_truncation_line(report["truncation"]))
    for w in report["warnings"]:
        warn(console, w)


def _prompts_line(prompts: dict | None) -> str | None:
    if prompts is None:
        return None
    if not any(v["prompt"] for v in prompts.values()):
        return "prompts: none (neither data.prompts nor the model sets one)"
    return "prompts: " + "; ".join(f"{r} {v['prompt']!r} ({v['from']})" for r, v in prompts.items())


def _truncation_line(t: dict) -> str:
    if not t["columns"]:
        return f"model loads; max_seq_length {t['max_seq_length']}; truncation unchecked (no rows)"
    rows = t["rows_checked"]
    cols = ", ".join(
        f"{c['column']} {c['truncated']} ({100 * c['truncated'] / rows if rows else 0:.1f}%; longest "
        f"{c['max_tokens']} tokens)"
        for c in t["columns"]
    )
    if t.get("stored_ids"):  # a prepared source: its ids are already cut; the texts' lengths are unknown
        return (
            f"truncation at max_seq_length {t['max_seq_length']} ({rows} rows checked, prepared token ids: the "
            f"texts are not stored, so rows cut cannot be told from rows of exactly that length): rows at "
            f"max_seq_length: {cols}"
        )
    return f"truncation at max_seq_length {t['max_seq_length']} ({rows} rows checked): rows cut: {cols}"


def print_first_row(console: Console, data) -> None:
    """The first training row after column mapping, one table row per role (``validate --verbose``)."""
    table = Table("role", "first training row")
    for key, value in data.first_row().items():
        table.add_row(key, value)
    console.print(table)


def print_data_report(console: Console, reports) -> None:
    """The ``cembed inspect-data`` tables (one :class:`cembed.data.inspect.DataReport` per training
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
    """A table of :func:`cembed.data.truncation.truncation_report` (``ColumnTruncation`` rows)."""
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
    :class:`cembed.data.truncation.ModelTruncation` or the :class:`~cembed.errors.UserError` that kept the model
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
