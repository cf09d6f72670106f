"""The ``cembed mine-negatives`` command's signature (options and help), kept out of :mod:`cembed.cli.app`
for its length: it loads nothing itself, calls :func:`cembed.data.mining.mine_negatives` and hands the
report to :func:`cembed.cli.report.print_mining_report`. Registered by :mod:`cembed.cli.app`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


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
    output_format: str = typer.Option(
        "columns", "--output-format", help="columns: negative_1..k per pair; rows: one row per negative."
    ),
    group_column: Optional[str] = typer.Option(
        None,
        "--group-column",
        help="Texts sharing this column's value (e.g. image_id) are never negatives of each other.",
    ),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", min=1, help="Use only the first N rows."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Encoding batch size."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="Embedding cache (as cembed eval's)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Encode even when cached; write no cache."),
) -> None:
    """Mine hard negatives for a pair file with a model (sentence-transformers' mine_hard_negatives)."""
    from cembed.cli.report import make_console, print_mining_report
    from cembed.data.mining import mine_negatives

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
