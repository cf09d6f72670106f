"""The commands that prepare a run, each with its options, body and rendering: ``cembed init`` (a
starter config for a data file), ``cembed suggest-lr`` (a learning rate for a new batch size) and
``cembed mine-negatives`` (hard negatives for a pair file). Registered by :mod:`cembed.cli.app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import typer
from rich.console import Console
from rich.table import Table

from cembed.cli.common import Device, LRRule, OutputFormat, console, examples, flag, make_console, warn
from cembed.errors import UserError
from cembed.samples import EXAMPLES

# The packaged example configs, as a choice (`cembed init OUT --example NAME`).
ExampleName = Literal[tuple(EXAMPLES)]  # type: ignore[valid-type]

INIT_EXAMPLES = examples(
    "cembed init quickstart.yaml --example quickstart",
    "cembed init my.yaml --model all-MiniLM-L6-v2 --data pairs.jsonl",
)
SUGGEST_LR_EXAMPLES = examples(
    "cembed suggest-lr --base-lr 2e-5 --base-bs 32 --bs 65536",
    "cembed suggest-lr --base-lr 2e-5 --base-bs 32 --bs 65536 --rule linear",
)
MINE_NEGATIVES_EXAMPLES = examples(
    "cembed mine-negatives cembed:coco-captions -o mined.jsonl.gz --num-negatives 3 --relative-margin 0.05",
    "cembed mine-negatives pairs.jsonl --model all-MiniLM-L6-v2 -o mined.jsonl.gz --output-format rows --no-cache",
)


def init_cmd(
    out: Path = typer.Argument(..., help="The config file to write (never overwritten)."),
    data: Optional[Path] = typer.Option(
        None, "--data", help="Training data: .jsonl[.gz], .json, .csv, .tsv or .parquet."
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
        raise UserError("cembed init: give --data FILE (or --example quickstart)")
    from cembed.data.starter import make_starter, write_starter

    starter = make_starter(out, model, data)
    write_starter(starter)
    print_starter(console, starter)


def suggest_lr_cmd(
    base_lr: float = typer.Option(..., "--base-lr", help="Learning rate tuned at --base-bs, e.g. 2e-5."),
    base_bs: int = typer.Option(..., "--base-bs", help="Batch size the base LR was tuned at, e.g. 32."),
    bs: int = typer.Option(..., "--bs", help="Samples per optimizer step now (batch x GPUs x accumulation)."),
    rule: LRRule = typer.Option("sqrt", "--rule", help="Scaling rule: sqrt (default) or linear."),
) -> None:
    """Suggest a learning rate for a new batch size (sqrt rule by default) and a bracket to try."""
    from cembed.plan.lr import suggest_lr

    print_suggestion(console, suggest_lr(base_lr, base_bs, bs, rule), base_lr, base_bs, bs)  # type: ignore[arg-type]


def mine_negatives_cmd(
    data: str = typer.Argument(..., help="Pair file (.jsonl[.gz], .json, .csv, .tsv, .parquet) or cembed:<sample>."),
    model: str = typer.Option("all-MiniLM-L6-v2", "--model", help="Model that ranks the candidates (folder or name)."),
    output: Path = typer.Option(..., "--output", "-o", help="File to write: .jsonl or .jsonl.gz."),
    anchor_column: str = typer.Option("anchor", "--anchor-column", help="Column of the anchors (queries)."),
    positive_column: str = typer.Option("positive", "--positive-column", help="Column of the positives."),
    num_negatives: int = typer.Option(3, "--num-negatives", "-k", help="Negatives per pair."),
    range_min: int = typer.Option(0, "--range-min", help="Skip this many of the most similar candidates."),
    range_max: Optional[int] = typer.Option(None, "--range-max", help="Consider only this many nearest candidates."),
    relative_margin: Optional[float] = typer.Option(
        None, "--relative-margin", help="Drop candidates scoring above positive - |positive| x margin (e.g. 0.05)."
    ),
    absolute_margin: Optional[float] = typer.Option(
        None, "--absolute-margin", help="Drop candidates scoring above positive - margin (e.g. 0.1)."
    ),
    output_format: OutputFormat = typer.Option(
        "columns", "--output-format", help="columns: negative_1..k per pair; rows: one row per negative."
    ),
    group_column: Optional[str] = typer.Option(
        None,
        "--group-column",
        help="Texts sharing this column's value (e.g. image_id) are never negatives of each other.",
    ),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", min=1, help="Use only the first N rows."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Encoding batch size."),
    device: Device = typer.Option("auto", "--device", help="Where to encode (auto: CUDA when available)."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="Embedding cache (as cembed eval's)."),
    cache: bool = flag(
        True, "--cache/--no-cache", help="Reuse and write the embedding cache (--no-cache: encode anew)."
    ),
) -> None:
    """Mine hard negatives for a pair file with a model (sentence-transformers' mine_hard_negatives)."""
    from cembed.data.mining import mine_negatives

    no_cache = not cache

    report = mine_negatives(
        data,
        model,
        output,
        anchor_column,
        positive_column,
        num_negatives,
        range_min,
        range_max,
        relative_margin,
        absolute_margin,
        output_format,
        group_column,
        max_samples,
        batch_size,
        device,
        cache_dir,
        no_cache,
    )
    print_mining_report(make_console(), report)


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


def print_suggestion(console: Console, s, base_lr: float, base_bs: int, bs: int) -> None:
    """The ``cembed suggest-lr`` answer: suggestion, both rules and the bracket to try."""
    lo, hi = s.bracket
    console.print(f"suggested learning_rate: [bold]{s.suggested:.3e}[/] ({s.rule} rule)", highlight=False)
    console.print(f"  sqrt rule:   {s.sqrt:.3e} = {base_lr:g} x sqrt({bs}/{base_bs})", highlight=False)
    console.print(f"  linear rule: {s.linear:.3e} = {base_lr:g} x ({bs}/{base_bs})", highlight=False)
    console.print(
        f"  bracket to try: {lo:.3e} .. {hi:.3e} (x0.5, x2; halve/double from the suggestion)", highlight=False
    )


def print_mining_report(console: Console, report) -> None:
    """``cembed mine-negatives``' result: :meth:`cembed.data.mining.MiningReport.lines`, as plain text."""
    for line in report.lines():
        console.print(line, highlight=False, markup=False)
