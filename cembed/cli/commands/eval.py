"""``cembed eval``: its options, the call to :mod:`cembed.eval.score` and the rendering of its report
(with ``--dims``: one column per embedding size). Registered by :mod:`cembed.cli.app`.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from cembed.cli.common import Device, console, examples, flag

if TYPE_CHECKING:
    from cembed.eval.score import EvalReport

EVAL_EXAMPLES = examples(
    "cembed eval --model all-MiniLM-L6-v2 -r cembed:coco-captions-heldout",
    "cembed eval --model runs/quickstart -r cembed:coco-captions-heldout --json after.json",
    "cembed eval --model runs/quickstart --sts sts-test.csv --dims 384,128,64",
)


def eval_cmd(
    model: str = typer.Option(
        ..., "--model", "-m", help="Saved model folder, a run's output_dir, or all-MiniLM-L6-v2."
    ),
    retrieval: Optional[List[Path]] = typer.Option(
        None,
        "--retrieval",
        "-r",
        help="BEIR folder (corpus.jsonl[.gz], queries.jsonl, qrels/) or cembed:coco-captions-heldout. Repeatable.",
    ),
    sts: Optional[List[Path]] = typer.Option(
        None, "--sts", help="STS file (STS Benchmark TSV, sentence1/sentence2/score TSV or JSONL). Repeatable."
    ),
    split: str = typer.Option("test", "--split", help="qrels split of the retrieval sets: qrels/<split>.tsv."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write every metric to this JSON file."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Encoding batch size."),
    max_seq_length: Optional[int] = typer.Option(
        None, "--max-seq-length", min=1, help="Override the model's max_seq_length."
    ),
    device: Device = typer.Option("auto", "--device", help="Where to encode (auto: CUDA when available)."),
    cache_dir: Optional[Path] = typer.Option(
        None,
        "--cache-dir",
        help="Cache root: corpus embeddings in <root>/embeddings (default $CEMBED_CACHE_DIR or ~/.cache/cembed).",
    ),
    cache: bool = flag(
        True,
        "--cache/--no-cache",
        help="Reuse and write cached corpus embeddings (--no-cache: encode anew, write none).",
    ),
    dims: Optional[str] = typer.Option(None, "--dims", help="Also score truncated embeddings, e.g. 384,128,64."),
) -> None:
    """Score a model on retrieval (NDCG@10, MRR@10, MAP@100, Recall@10/100) and STS (cosine Spearman) sets."""
    from cembed.eval.score import score_model
    from cembed.samples import resolve_sample

    no_cache = not cache
    # cembed:<name>: packaged data
    sets = ([resolve_sample(str(p)) or p for p in retrieval or []], [resolve_sample(str(p)) or p for p in sts or []])
    cache = None if no_cache else cache_dir
    if dims is not None:
        from cembed.eval.score import parse_dims, score_dims

        args = (split, batch_size, max_seq_length, device, cache, no_cache, json_out)
        return print_dims_report(console, score_dims(model, *sets, parse_dims(dims), *args))
    args = (split, json_out, batch_size, max_seq_length, device, cache, no_cache)
    print_eval_report(console, score_model(model, *sets, *args, progress=encode_progress(console)))


# --- rendering ----------------------------------------------------------------------------------


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
            shown = f"{value:.1f}" if label.startswith("active dims") else f"{value:.5f}"  # a count, not a score
            table.add_row(name if i == 0 else "", size if i == 0 else "", label, shown)
        if entry["kind"] == "retrieval":
            how = "from cache" if entry["corpus_cache_hit"] else f"encoded in {entry['encode_seconds']:.1f}s"
            table.add_row("", "", "corpus", how)
    console.print(table)
    if report.json_out is not None:
        console.print(f"metrics written to {report.json_out}", highlight=False)


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
