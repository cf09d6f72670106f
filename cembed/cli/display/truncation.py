"""What a model check found, as ``validate --verbose`` and ``probe-minibatch`` print it: the
weights' dtypes, the prompts, the attention path and the truncation table
(a :class:`cembed.data.truncation.ModelTruncation`).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


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
        if c.limit is not None and c.limit != max_seq_length:  # a column cut at its own length
            name += f" (cut at {c.limit})"
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
