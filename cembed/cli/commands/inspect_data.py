"""``cembed inspect-data``: duplicates in the training data and how the no-duplicates sampler will
batch it (:func:`cembed.data.inspect.inspect_data`), one table per source. Registered by
:mod:`cembed.cli.app`.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from cembed.cli.common import ConfigArg, OverridesArg, console, examples, load, warn

INSPECT_DATA_EXAMPLES = examples(
    "cembed inspect-data quickstart.yaml",
    "cembed inspect-data quickstart.yaml batch.per_device_train_batch_size=1024",
)


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


# --- rendering ----------------------------------------------------------------------------------


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
