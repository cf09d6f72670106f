"""The ``cembed`` command line: the Typer app and one registration line per command.

Each command lives with its options, body and rendering in its group's module: :mod:`cembed.cli.check`
(validate, inspect-data, probe-minibatch), :mod:`cembed.cli.train` (train), :mod:`cembed.cli.prepare`
(init, suggest-lr, mine-negatives) and :mod:`cembed.cli.eval` (eval); what they share is in
:mod:`cembed.cli.common`. A new command is a function in its group's module and one line here.

User mistakes (:class:`cembed.errors.UserError`) print one or two lines in red and exit with code 2.
"""

from __future__ import annotations

import sys

import typer

from cembed.cli.check import inspect_data_cmd, probe_minibatch_cmd, validate_cmd
from cembed.cli.common import err_console, user_errors
from cembed.cli.eval import eval_cmd
from cembed.cli.prepare import init_cmd, mine_negatives_cmd, suggest_lr_cmd
from cembed.cli.train import train_cmd

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Fine-tune sentence-embedding models with contrastive losses at batch sizes far beyond GPU memory.",
)

app.command("suggest-lr")(user_errors(suggest_lr_cmd))
app.command("validate")(user_errors(validate_cmd))
app.command("init")(user_errors(init_cmd))
app.command("inspect-data")(user_errors(inspect_data_cmd))
app.command("train")(user_errors(train_cmd))
app.command("probe-minibatch")(user_errors(probe_minibatch_cmd))
app.command("eval")(user_errors(eval_cmd))
app.command("mine-negatives")(user_errors(mine_negatives_cmd))


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
