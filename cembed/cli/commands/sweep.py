"""``cembed sweep``: short runs at the sqrt-scaled LR times each factor, scored on the eval sets
(:mod:`cembed.train.sweep`); prints the table, the trials' warnings, the plot's path and the chosen
``optim.learning_rate``.
Registered by :mod:`cembed.cli.app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from cembed.cli.common import ConfigArg, OverridesArg, console, err_console, examples, load, warn

SWEEP_EXAMPLES = examples(
    "cembed sweep quickstart.yaml",
    "cembed sweep quickstart.yaml --lr-factors 0.25,0.5,1,2,4 --steps 50",
    "cembed sweep quickstart.yaml --metric coco-heldout_cosine_mrr@10 --out runs/lr-sweep",
    "cembed sweep quickstart.yaml batch.per_device_train_batch_size=256 --lr-factors 0.5,1,2",
    "cembed sweep quickstart.yaml batch.per_device_train_batch_size=256 --overwrite",
)


def sweep_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    lr_factors: str = typer.Option(
        "0.5,1,2", "--lr-factors", help="Comma-separated factors of the sqrt-scaled (effective) learning rate."
    ),
    steps: int = typer.Option(20, "--steps", help="Optimizer steps per trial."),
    metric: Optional[str] = typer.Option(
        None, "--metric", help="Eval metric to compare (default: eval.metric_for_best_model, else the headline one)."
    ),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        help="Sweep folder (default <train.output_dir>-lr-sweep); a rerun of the same config resumes its study.",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Move the folder's previous study and runs aside (into <out>/study-<time>/) and sweep afresh.",
    ),
) -> None:
    """Search the learning rate: short runs at the scaled LR x each factor, one more beyond an edge best.

    A rerun reads back the trials of the same config; a study another config ran is refused (naming
    what changed) unless --overwrite moves it aside."""
    from cembed.train.sweep import parse_factors, sweep_metric

    factors = parse_factors(lr_factors)
    sweep_metric(load(config, overrides), metric)  # no eval sets / unknown metric: exit 2 before any training

    from cembed.train.sweep import run_sweep, write_sweep

    def on_trial(event: str, factor: float, lr: float) -> None:
        what = {"start": "training", "done": "done", "cached": "finished before, read back"}[event]
        console.print(f"trial x{factor:g} (learning rate {lr:.3e}): {what}", highlight=False)

    from cembed.errors import RunInterrupted

    try:
        result = run_sweep(config, factors, steps, out, metric, overrides, on_trial, overwrite=overwrite)
    except RunInterrupted as stop:  # SIGINT/SIGTERM in a trial: it is marked failed in the study
        err_console.print(
            f"[yellow]{stop}[/]: the finished trials are kept; rerun the same command to train the missing ones",
            highlight=False,
        )
        raise typer.Exit(stop.exit_code) from None
    path, plot = write_sweep(result)
    if result.moved_aside is not None:
        console.print(f"moved the old sweep aside to {result.moved_aside}", highlight=False)
    table = Table(title=f"LR sweep ({result.steps} steps per trial): {result.metric}")
    for name in ("factor", "learning rate", result.metric, "loss at end"):
        table.add_column(name, justify="right")
    for t in result.trials:
        mark = " *" if t is result.best else ""
        loss = f"{t.last_loss:.4f}" if t.last_loss is not None else "-"
        table.add_row(
            f"x{t.factor:g}{' (edge)' if t.edge else ''}", f"{t.learning_rate:.3e}", f"{t.metric:.4f}{mark}", loss
        )
    console.print(table)
    for w in result.warnings:  # what every trial's run found before training (rows the sampler cannot place)
        warn(console, w)
    if result.metric_before is not None:
        console.print(f"before training: {result.metric} {result.metric_before:.4f}", highlight=False)
    console.print(f"effective learning_rate at x1: {result.lr_derivation}", highlight=False)
    console.print(
        f"best: x{result.best.factor:g} = effective LR {result.best.learning_rate:.3e}; use the override "
        f"[bold]{result.override}[/]",
        highlight=False,
    )
    console.print(f"wrote {path}" + (f" and {plot}" if plot else ""), highlight=False)
