"""What every command module shares: the consoles, the config argument and its overrides, the
UserError handler, config loading, and the lines and plan every command may print.

Command and display modules import only the standard library, typer, rich, cembed's light modules
(errors, files, samples) and the CLI's own modules at import time; the rest of cembed (torch,
transformers, datasets) is imported inside each command, so ``cembed --help`` stays fast
(``tests/test_structure.py`` checks it).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

# Library progress bars (weights loading, shard writing) would interleave with cembed's own rich
# progress; tqdm reads this at import time, so it is set before anything imports tqdm.
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, List, Literal, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from cembed.errors import UserError

if TYPE_CHECKING:
    from cembed.config.schema import CembedConfig
    from cembed.plan.resolve import Plan


def word_wrapping_console(**options) -> Console:
    """A rich Console (``options`` as Console's) that breaks long lines between words on a terminal
    (at its width; a word longer than a line, e.g. a path, is the only thing ever split) and never
    breaks them when the output is a pipe or a file, where a line is a record to grep or parse.

    Rich's ``soft_wrap=True`` everywhere would leave the wrapping to the terminal, which cuts at the
    last column, inside a word."""
    out = Console(**options)
    out.soft_wrap = not out.is_terminal
    return out


console = word_wrapping_console()
err_console = word_wrapping_console(stderr=True)

ConfigArg = Annotated[Path, typer.Argument(help="YAML config file.")]
OverridesArg = Annotated[Optional[List[str]], typer.Argument(help="section.field=value overrides.")]

# Choice flags: typer lists the values in --help and refuses any other with exit code 2. They repeat
# the schema's and the library's Literal types (importing those here would load pydantic and data
# code for every `cembed --help`); tests/cli/test_app.py checks they do not drift apart.
Precision = Literal["auto", "fp32", "bf16", "fp16"]  # model.precision
Device = Literal["auto", "cpu", "cuda"]  # model.device
LRRule = Literal["sqrt", "linear"]  # cembed.plan.lr.Rule without "none"
OutputFormat = Literal["columns", "rows"]  # cembed.data.mining.OutputFormat


# Warnings the command line never shows (unless Python is told to: ``-W``, ``PYTHONWARNINGS``): every
# deprecation note (the libraries' own, e.g. transformers' ``is_gradient_checkpointing`` FutureWarning
# that peft triggers; a user cannot act on one) and the libraries' UserWarnings; cembed's own stay.
_HIDDEN = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
_NOT_CEMBED = r"(?!cembed(\.|$))"  # a warning's module: anything but cembed's


def filter_library_warnings() -> None:
    """Install the command line's warning filters (:data:`_HIDDEN` from any module, UserWarning from
    any module but cembed's), at the edge of cembed's output: the app's callback runs it before every
    command. Nothing when the user asked for warnings (``python -W ...``, ``PYTHONWARNINGS``)."""
    if sys.warnoptions:
        return
    for category in _HIDDEN:
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", category=UserWarning, module=_NOT_CEMBED)


def flag(default: bool, names: str, *short: str, help: str):
    """A boolean option declared as ``--name/--no-name`` (``names``) with an empty metavar: typer
    would otherwise print ``<bool>`` beside it, as if the flag took a value."""
    return typer.Option(default, names, *short, metavar="", help=help)


class _BareHelpOption:
    """The ``-h/--help`` row without a metavar: typer would print ``<bool>`` beside it, as if the
    flag took a value (the same reason :func:`flag` clears a boolean option's)."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class Command(_BareHelpOption, TyperCommand):
    """Every command's class (``app.command(cls=Command)``): its ``--help`` row shows no ``<bool>``."""


class Group(_BareHelpOption, TyperGroup):
    """The app's class (``typer.Typer(cls=Group)``): ``cembed --help``'s own row shows no ``<bool>``."""


def examples(*commands: str) -> str:
    """The ``epilog`` of a command's ``--help``: an "Examples" heading and one indented command line
    each (rich markup in them escaped). The leading blank line keeps the indentation, which
    typer's ``inspect.cleandoc`` would otherwise strip."""
    return "\n[bold]Examples[/]\n" + "\n".join(f"  {escape(c)}" for c in commands)


def user_errors(fn):
    """Turn a UserError into a short red message and exit code 2 (never a traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            where = (
                escape(f"[rank {os.environ['RANK']}] ")
                if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
                else ""
            )
            err_console.print(f"{where}[bold red]error:[/] {escape(str(err))}", highlight=False, markup=True)
            raise typer.Exit(err.exit_code) from None

    return wrapper


def load(config: Path, overrides: list[str] | None) -> CembedConfig:
    """The config file with the command line's ``section.field=value`` overrides applied.

    Raises:
        UserError: see :func:`cembed.config.file.load_config`.
    """
    from cembed.config.file import load_config

    return load_config(config, overrides or [])


def world_size_from_flags(nproc_per_node: int | None, nnodes: int) -> int | None:
    """World size asked for on the command line, or None (then $WORLD_SIZE or 1).

    Raises:
        UserError: either flag below 1.
    """
    if nproc_per_node is None and nnodes == 1:
        return None
    if (nproc_per_node or 1) < 1 or nnodes < 1:
        raise UserError(f"--nproc-per-node {nproc_per_node} / --nnodes {nnodes}: both must be at least 1")
    return (nproc_per_node or 1) * nnodes


def make_console(quiet: bool = False) -> Console:
    """A console for cembed's output (``quiet``: prints nothing, for ranks other than 0)."""
    return word_wrapping_console(quiet=quiet)


def warn(console: Console, text: str) -> None:
    """One yellow ``warning:`` line."""
    console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False)  # [..] in text is not markup


def note(console: Console, text: str) -> None:
    """One yellow ``note:`` line."""
    console.print(f"[yellow]note:[/] {escape(text)}", highlight=False)


def print_plan(console: Console, plan: Plan, warnings: tuple[str, ...] = ()) -> None:
    """World size, effective batch, gathering, the LR derivation, the plan's warnings and ``warnings``
    (what the checks before training found: the data's, the rows the sampler cannot place)."""
    per_node = f" ({plan.world_size} processes)" if plan.world_size > 1 else ""
    chosen = " (batch.global_batch_size)" if plan.global_batch_size is not None else ""
    console.print(
        f"world size: {plan.world_size}{per_node}   effective batch{chosen}: {plan.per_device_train_batch_size} per device x "
        f"{plan.world_size} x {plan.gradient_accumulation_steps} accumulation = {plan.samples_per_step} samples per "
        f"optimizer step   gather_across_devices: {str(plan.gather_across_devices).lower()}",
        highlight=False,
    )
    console.print(f"effective learning_rate: {plan.lr_derivation}", highlight=False)
    console.print(f"data-loader workers: {plan.dataloader_workers}", highlight=False)
    for w in (*plan.warnings, *warnings):
        warn(console, w)
