"""``cembed suggest-lr``: a learning rate for a new batch size (:func:`cembed.plan.lr.suggest_lr`: the
sqrt or linear rule) and a bracket to try. Registered by :mod:`cembed.cli.app`.
"""

from __future__ import annotations

import typer
from rich.console import Console

from cembed.cli.common import LRRule, console, examples

SUGGEST_LR_EXAMPLES = examples(
    "cembed suggest-lr --base-lr 2e-5 --base-bs 32 --bs 65536",
    "cembed suggest-lr --base-lr 2e-5 --base-bs 32 --bs 65536 --rule linear",
)


def suggest_lr_cmd(
    base_lr: float = typer.Option(..., "--base-lr", help="Learning rate tuned at --base-bs, e.g. 2e-5."),
    base_bs: int = typer.Option(..., "--base-bs", help="Batch size the base LR was tuned at, e.g. 32."),
    bs: int = typer.Option(..., "--bs", help="Samples per optimizer step now (batch x GPUs x accumulation)."),
    rule: LRRule = typer.Option("sqrt", "--rule", help="Scaling rule: sqrt (default) or linear."),
) -> None:
    """Suggest a learning rate for a new batch size (sqrt rule by default) and a bracket to try."""
    from cembed.plan.lr import suggest_lr

    print_suggestion(console, suggest_lr(base_lr, base_bs, bs, rule), base_lr, base_bs, bs)  # type: ignore[arg-type]


# --- rendering ----------------------------------------------------------------------------------


def print_suggestion(console: Console, s, base_lr: float, base_bs: int, bs: int) -> None:
    """The ``cembed suggest-lr`` answer: suggestion, both rules and the bracket to try."""
    lo, hi = s.bracket
    console.print(f"suggested learning_rate: [bold]{s.suggested:.3e}[/] ({s.rule} rule)", highlight=False)
    console.print(f"  sqrt rule:   {s.sqrt:.3e} = {base_lr:g} x sqrt({bs}/{base_bs})", highlight=False)
    console.print(f"  linear rule: {s.linear:.3e} = {base_lr:g} x ({bs}/{base_bs})", highlight=False)
    console.print(
        f"  bracket to try: {lo:.3e} .. {hi:.3e} (x0.5, x2; halve/double from the suggestion)", highlight=False
    )
