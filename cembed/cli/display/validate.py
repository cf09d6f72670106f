"""What ``cembed validate`` shows: :func:`validation_report` (the JSON of ``--json``, from the
run's :class:`cembed.train.facts.RunFacts`, the plan, the data and the model's checks) and
:func:`print_validation`, its summary of about a dozen lines; :func:`print_first_row` for ``--verbose``.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cembed.cli.common import warn
from cembed.files import display_path


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


def validation_report(cfg, plan, data, facts, truncation, warnings: tuple[str, ...] = ()) -> dict:
    """What ``cembed validate`` found, as JSON-ready values (``--json`` prints it, the summary renders it).

    Args:
        cfg: the loaded config; plan: its :class:`cembed.plan.resolve.Plan`.
        data: a :class:`cembed.data.rows.TrainingData`, or ``UnloadedData`` (hub offline).
        facts: the run's :class:`cembed.train.facts.RunFacts` (batches, steps, warmup).
        truncation: a :class:`cembed.data.truncation.ModelTruncation`, or the UserError that kept the
            model from loading (then ``model.load_error`` holds it and the model's facts are None).
        warnings: the findings beside the plan's own warnings (data, unplaceable rows).

    Returns:
        ``{model, loss, data, batch, learning_rate, steps, device, truncation, warnings, plan,
        config}``. ``data.batches_per_epoch`` counts global batches from the rows (``rows / batch``,
        a short last batch counted unless ``drop_last``, per source, in the sampling schedule); the
        no-duplicates sampler can build fewer, and then a warning says how many. ``steps.total`` is
        ``train.max_steps``, else epochs x ``ceil(batches / accumulation)``; None when the rows are
        unknown (unloaded hub data). ``model`` also holds what the model's kind says changes its encoding
        (``ModelKind.encode_settings``: a sparse model's ``max_active_dims``, null where there is no cap).
    """
    loaded = hasattr(data, "dataset")
    model_ok = not isinstance(truncation, Exception)
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
                "batches_per_epoch": batches,
            }
            for s, batches in zip(data.sources, facts.source_batches)
        ]
        for entry in sources:  # the prompts each source trains with: its own over data.prompts, the model's
            entry["prompts"] = _source_prompts(truncation, entry["name"]) if model_ok else None
        first = data.first_row()
        stream = data.streamed
        if stream is not None:  # only the first rows were read: nothing is counted
            sources[0] |= {"rows_read": None, "rows_dropped": None, "rows": None, "rows_checked": data.rows_read}
        data_facts = {
            "loaded": True,
            "streaming": stream.model_dump() if stream is not None else None,
            "rows_read": None if stream else data.rows_read,
            "rows_dropped": None if stream else data.rows_dropped,
            "rows": None if stream else len(data.dataset),
            "batches_per_epoch": facts.batches_per_epoch,
            "sampling": cfg.data.sampling.resolved_strategy if len(sources) > 1 else None,
            "sources": sources,
            "first_row": first,
        }
    else:
        columns = cfg.data.sources()[0].columns
        roles = {"anchor": columns.anchor, "positive": columns.positive}
        roles |= {f"negative_{i + 1}": n for i, n in enumerate(columns.negatives)}
        data_facts = {"loaded": False, "source": data.source, "reason": data.reason, "batches_per_epoch": None}
    steps = facts.steps
    trunc = None
    if model_ok:
        trunc = {
            "max_seq_length": truncation.max_seq_length,
            "rows_checked": truncation.columns[0].rows if truncation.columns else 0,
            "stored_ids": truncation.stored_ids,
            "columns": [
                {
                    "column": c.column,
                    "source": c.source,
                    "truncated": c.truncated,
                    "max_tokens": c.max_tokens,
                    "limit": c.limit or truncation.max_seq_length,  # where this column is cut
                }
                for c in truncation.columns
            ],
        }
    weights = truncation.weights if model_ok else None
    return {
        "model": {
            "kind": cfg.model.kind,
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
            # what the kind says changes its encoding, e.g. a sparse model's max_active_dims (null: no cap)
            **((truncation.encode_settings or {}) if model_ok else {}),
        },
        "loss": {
            "name": cfg.loss.name,
            "columns": roles,
            **({"description": cfg.loss.describe()} if cfg.loss.describe() else {}),
            **_scoring_memory(cfg, plan, truncation, model_ok),
        },
        "data": data_facts,
        "batch": {
            "per_device_train_batch_size": plan.per_device_train_batch_size,
            "global_batch_size": plan.global_batch_size,  # the config's, when set (the per-device batch follows)
            "world_size": plan.world_size,
            "gradient_accumulation_steps": plan.gradient_accumulation_steps,
            "samples_per_step": plan.samples_per_step,
            "mini_batch_size": plan.mini_batch_size if plan.mini_batch_size is not None else "auto",
            "mini_batch_num_tokens": plan.mini_batch_num_tokens,
            "gather_across_devices": plan.gather_across_devices,
            "drop_last": facts.drop_last,
        },
        "learning_rate": {"effective": plan.learning_rate, "derivation": plan.lr_derivation},
        "steps": {"total": steps.total, "from": steps.total_from, "per_epoch": steps.per_epoch, "warmup": steps.warmup},
        "device": {
            "device": plan.device,
            "precision": plan.precision,
            "precision_reason": plan.precision_reason or plan.precision,
            "dataloader_workers": plan.dataloader_workers,
        },
        "truncation": trunc,
        "warnings": [*plan.warnings, *warnings, *([] if loaded else [data.message])],
        "plan": plan.to_dict(),
        "config": plan.config_as_run(cfg),  # the per-device batch a batch.global_batch_size derives
    }


def _scoring_memory(cfg, plan, truncation, model_ok: bool) -> dict:
    """``{"scoring_memory": {bytes, tiles}}``: the loss's scoring memory bound (``LossConfig.scoring_memory``)
    for this run's per-device batch and query length; empty when the loss states none (or the length
    is unknown)."""
    length = truncation.max_seq_length if model_ok else cfg.model.max_seq_length
    if length is None:
        return {}
    bound = cfg.loss.scoring_memory(cfg.model.query_tokens(int(length)), plan.per_device_train_batch_size)
    return {} if bound is None else {"scoring_memory": {"bytes": bound[0], "tiles": bound[1]}}


def _loss_line(loss: dict) -> str:
    """The summary's loss line: the loss, its columns, how it trains, its scoring memory bound."""
    cols = ", ".join(role if role == src else f"{role} <- {src}" for role, src in loss["columns"].items())
    scoring = loss.get("scoring_memory")
    bound = (
        f"; {scoring['tiles']}: scoring memory at most {scoring['bytes'] / 2**20:.1f} MiB, whatever the batch"
        if scoring
        else ""
    )
    how = f"; {loss['description']}" if loss.get("description") else ""
    return f"loss: {loss['name']} on {cols}{how}{bound}"


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
    kind = f"   kind: {m['kind']}" if m.get("kind", "dense") != "dense" else ""
    p(f"model: {m['name_or_path']} ({length}){kind}   pooling: {m['pooling']}")
    p(_loss_line(report["loss"]))
    if d["loaded"]:
        sources = d["sources"]
        what = _source_shown(sources[0]) if len(sources) == 1 else f"{len(sources)} sources"
        per_epoch = (
            f"{d['batches_per_epoch']} batches of {b['per_device_train_batch_size'] * b['world_size']} per epoch"
        )
        if d.get("streaming"):
            w = d["streaming"]
            ranks = (
                f" (global batches of {b['world_size']} processes: each reads the whole stream and trains its slice)"
                if b["world_size"] > 1
                else ""
            )
            p(
                f"data: {what}: a stream (rows not counted); its first {sources[0]['rows_checked']} rows checked "
                f"(columns, cells); no-duplicate batches{ranks} over a window of {w['window_batches']} batches, "
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
    chosen = " (batch.global_batch_size)" if b.get("global_batch_size") is not None else ""
    p(
        f"batch: world size: {b['world_size']}{processes}   effective batch{chosen}: {b['per_device_train_batch_size']} per "
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
        prompts = _prompts_lines(m["prompts"], d["sources"] if d["loaded"] else [])
        for line in (m["weights_line"], *prompts, m["attention"] and f"attention: {m['attention']}"):
            if line:
                p(line)
        p(_truncation_line(report["truncation"]))
    for w in report["warnings"]:
        warn(console, w)


def _source_prompts(truncation, name: str) -> dict | None:
    """A source's prompts as ``RolePrompts.to_dict`` gives them: its own where a source sets some
    (``truncation.source_prompts``), else the run's."""
    own = (truncation.source_prompts or {}).get(name)
    prompts = own if own is not None else truncation.prompts
    return prompts.to_dict() if prompts is not None else None


def _prompts_lines(run: dict | None, sources: list[dict]) -> list[str]:
    """The prompts line: the run's (``data.prompts``, else the model's), or, where a source sets its
    own, one line per source (a single source: one line) with the prompts it trains with."""
    if run is None:
        return []
    shown = [s for s in sources if s.get("prompts") is not None]
    if not shown or all(s["prompts"] == run for s in shown):
        if not any(v["prompt"] for v in run.values()):
            return ["prompts: none (neither data.prompts nor the model sets one)"]
        return ["prompts: " + "; ".join(f"{r} {v['prompt']!r} ({v['from']})" for r, v in run.items())]
    if len(shown) == 1:
        return [f"prompts: {_role_prompts(shown[0]['prompts'])}"]
    return [f"prompts of source {s['name']}: {_role_prompts(s['prompts'])}" for s in shown]


def _role_prompts(prompts: dict) -> str:
    """``anchor 'query: ' (data.prompts.anchor); ...`` for the roles with a prompt, else ``none``."""
    return "; ".join(f"{r} {v['prompt']!r} ({v['from']})" for r, v in prompts.items() if v["prompt"]) or "none"


def _truncation_line(t: dict) -> str:
    if not t["columns"]:
        return f"model loads; max_seq_length {t['max_seq_length']}; truncation unchecked (no rows)"
    rows = t["rows_checked"]
    cols = ", ".join(
        f"{c['column']} {c['truncated']} ({100 * c['truncated'] / rows if rows else 0:.1f}%; longest "
        f"{c['max_tokens']} tokens"
        + (f"; cut at {c['limit']} tokens" if c.get("limit", t["max_seq_length"]) != t["max_seq_length"] else "")
        + ")"
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
