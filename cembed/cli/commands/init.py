"""``cembed init``: a commented starter config for a model and a data file
(:func:`cembed.data.starter.make_starter`: column roles, a batch size the no-duplicates sampler can
fill), or a packaged example config. Registered by :mod:`cembed.cli.app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import typer
from rich.console import Console
from rich.table import Table

from cembed.cli.common import console, examples, warn
from cembed.errors import UserError
from cembed.samples import EXAMPLES

# The packaged example configs, as a choice (`cembed init OUT --example NAME`).
ExampleName = Literal[tuple(EXAMPLES)]  # type: ignore[valid-type]

INIT_EXAMPLES = examples(
    "cembed init quickstart.yaml --example quickstart",
    "cembed init colbert.yaml --example colbert-quickstart",
    "cembed init my.yaml --model all-MiniLM-L6-v2 --data pairs.jsonl",
)


def init_cmd(
    out: Path = typer.Argument(..., help="The config file to write (never overwritten)."),
    data: Optional[Path] = typer.Option(
        None,
        "--data",
        help="Training data: .jsonl, .json, .csv, .tsv (plain, .gz, .bz2, .xz or .zst), .parquet, or a save_to_disk folder.",
    ),
    model: str = typer.Option("all-MiniLM-L6-v2", "--model", help="Model folder or hub id to fine-tune."),
    example: Optional[ExampleName] = typer.Option(None, "--example", help="Write a packaged example config instead."),
) -> None:
    """Write a commented starter config for a model and a data file (proposes the column roles and a
    per_device_train_batch_size the no-duplicates sampler can fill), or a packaged --example."""
    if example is not None:  # a file copy: no data library to import
        from cembed.files import write_new_file
        from cembed.samples import example_config

        write_new_file(out, example_config(example))
        console.print(f"wrote {out} (example {example}); next: cembed train {out}", highlight=False)
        return
    if data is None:
        raise UserError(f"cembed init: give --data FILE (or --example {' | '.join(EXAMPLES)})")
    from cembed.data.starter import make_starter, write_starter

    starter = make_starter(out, model, data)
    write_starter(starter)
    print_starter(console, starter)


# --- rendering ----------------------------------------------------------------------------------


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
    trained = s.rows - s.rows_invalid
    console.print(
        f"per_device_train_batch_size: {s.batch_size} ({s.batches} batches per epoch, {s.unused} of {trained} rows "
        f"unused; largest duplicate-free batch found: {s.largest_batch}; at least 4 steps per epoch)",
        highlight=False,
    )
    if s.why:
        warn(console, s.why)
    console.print(f"next: cembed validate {s.out}", highlight=False)
