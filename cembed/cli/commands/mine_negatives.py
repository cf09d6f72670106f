"""``cembed mine-negatives``: hard negatives for a pair file, ranked by a model
(:func:`cembed.data.mining.mine_negatives`, sentence-transformers' ``mine_hard_negatives``).
Registered by :mod:`cembed.cli.app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from cembed.cli.common import Device, OutputFormat, examples, flag, make_console

MINE_NEGATIVES_EXAMPLES = examples(
    "cembed mine-negatives cembed:coco-captions -o mined.jsonl.gz --num-negatives 3 --relative-margin 0.05",
    "cembed mine-negatives pairs.jsonl --model all-MiniLM-L6-v2 -o mined.jsonl.gz --output-format rows --no-cache",
)


def mine_negatives_cmd(
    data: str = typer.Argument(
        ...,
        help="Pair file (.jsonl, .json, .csv, .tsv: plain, .gz, .bz2, .xz or .zst; .parquet), a save_to_disk folder, "
        "or cembed:<sample>.",
    ),
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


def print_mining_report(console: Console, report) -> None:
    """``cembed mine-negatives``' result: :meth:`cembed.data.mining.MiningReport.lines`, as plain text."""
    for line in report.lines():
        console.print(line, highlight=False, markup=False)
