"""The ``cembed`` command line: the Typer app and one registration line per command.

Each command is a module of :mod:`cembed.cli.commands` holding its options and body (validate,
inspect_data, probe_minibatch, init, suggest_lr, mine_negatives, train, estimate, eval, sweep,
prepare_data); the rendering several commands share and the training run's display are in
:mod:`cembed.cli.display`; what every command shares is in :mod:`cembed.cli.common`. A new command
is a module in ``commands/`` and one line here.

User mistakes (:class:`cembed.errors.UserError`) print one or two lines in red and exit with code 2.
Every command answers ``-h``/``--help`` with its examples last (the ``*_EXAMPLES`` beside each
command); ``cembed --version`` prints the installed package's version.
"""

from __future__ import annotations

import os
import sys

import typer

from cembed.cli.commands import (
    estimate,
    init,
    inspect_data,
    mine_negatives,
    prepare_data,
    probe_minibatch,
    suggest_lr,
    sweep,
    train,
    validate,
)
from cembed.cli.commands import eval as evaluate
from cembed.cli.common import Command, Group, err_console, filter_library_warnings, user_errors

app = typer.Typer(
    cls=Group,  # and each command's cls=Command: no <bool> beside -h/--help
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
    help="Fine-tune sentence-embedding models with contrastive losses at batch sizes far beyond GPU memory.",
)


def _print_version(value: bool) -> None:
    """``--version``: the installed distribution's version (pyproject.toml's, via importlib.metadata)."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"cembed {version('cembed')}")
        except PackageNotFoundError:  # a source tree on sys.path, never installed
            typer.echo("cembed: version unknown (not installed; pip install -e . records it)")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, metavar="", help="Print cembed's version and exit."
    ),
) -> None:
    # The app's own options, before any command; no docstring: the help is the Typer's ``help``.
    del version  # handled eagerly by its callback
    filter_library_warnings()  # the edge of cembed's output: no library deprecation note reaches it


app.command("suggest-lr", cls=Command, epilog=suggest_lr.SUGGEST_LR_EXAMPLES)(user_errors(suggest_lr.suggest_lr_cmd))
app.command("validate", cls=Command, epilog=validate.VALIDATE_EXAMPLES)(user_errors(validate.validate_cmd))
app.command("init", cls=Command, epilog=init.INIT_EXAMPLES)(user_errors(init.init_cmd))
app.command("inspect-data", cls=Command, epilog=inspect_data.INSPECT_DATA_EXAMPLES)(
    user_errors(inspect_data.inspect_data_cmd)
)
app.command("train", cls=Command, epilog=train.TRAIN_EXAMPLES)(user_errors(train.train_cmd))
app.command("probe-minibatch", cls=Command, epilog=probe_minibatch.PROBE_MINIBATCH_EXAMPLES)(
    user_errors(probe_minibatch.probe_minibatch_cmd)
)
app.command("eval", cls=Command, epilog=evaluate.EVAL_EXAMPLES)(user_errors(evaluate.eval_cmd))
app.command("mine-negatives", cls=Command, epilog=mine_negatives.MINE_NEGATIVES_EXAMPLES)(
    user_errors(mine_negatives.mine_negatives_cmd)
)
app.command("estimate", cls=Command, epilog=estimate.ESTIMATE_EXAMPLES)(user_errors(estimate.estimate_cmd))
app.command("sweep", cls=Command, epilog=sweep.SWEEP_EXAMPLES)(user_errors(sweep.sweep_cmd))
app.command("prepare-data", cls=Command, epilog=prepare_data.PREPARE_DATA_EXAMPLES)(
    user_errors(prepare_data.prepare_data_cmd)
)


def main() -> None:
    """Console-script entry point. A process started by the launcher for a multi-process job ends
    through :func:`cembed.distributed.group.exit_worker` (no interpreter finalization, where gloo's
    threads can abort or hang a finished run), with the exit code the command chose."""
    try:
        app()
        code = 0
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/]")
        code = 130
    except SystemExit as done:  # Typer ends every command this way
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        from cembed.distributed.group import exit_worker  # imports torch: only in a launched worker

        exit_worker(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
