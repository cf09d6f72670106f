"""The command line's shape: which commands exist, and that importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rich.console import Console

from cembed.cli.app import app

COMMANDS = [
    "suggest-lr",
    "validate",
    "init",
    "inspect-data",
    "train",
    "probe-minibatch",
    "eval",
    "mine-negatives",
    "estimate",
    "sweep",
    "prepare-data",
]


def test_registered_commands_are_the_expected_ones():
    """A command added, renamed or dropped is a deliberate change to this list (litgpt's guard)."""
    assert [c.name for c in app.registered_commands] == COMMANDS


@pytest.mark.slow
def test_importing_the_cli_loads_no_training_library():
    """``cembed --help`` stays fast: command modules import torch, transformers, datasets and
    sentence-transformers inside their commands only."""
    heavy = ["torch", "transformers", "datasets", "sentence_transformers"]
    code = f"import sys, cembed.cli.app; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_rich_run_display_without_progress_prints_only_what_the_run_is():
    from cembed.cli.display.run import RichRunDisplay

    console = Console(record=True, width=200)
    display = RichRunDisplay(console, progress=False)
    assert display.progress(None, 8) is None
    display.log_line("step 1/2 loss 1.0")
    display.eval_line("eval before training: s 0.5")
    display.probe_start("cpu")
    assert console.export_text() == "probing mini_batch_size on cpu (batch.mini_batch_size: auto)\n"


def test_rich_run_display_progress_is_a_trainer_callback():
    from transformers import TrainerCallback

    from cembed.cli.display.run import RichProgress, RichRunDisplay
    from cembed.train.trainer import RunLog

    console = Console(record=True, width=200)
    display = RichRunDisplay(console)
    bar = display.progress(RunLog(), 8)
    assert isinstance(bar, TrainerCallback) and isinstance(bar, RichProgress)
    assert type(bar).__name__ == "RichProgressCallback"
    display.log_line("before the bar starts: not shown")
    display.eval_line("eval before training: s 0.5")
    assert console.export_text() == "eval before training: s 0.5\n"


# --- what a person meets at the terminal: fast answers, -h, --version, examples, choices ---------

HEAVY = ("torch", "transformers", "sentence_transformers", "datasets")

# Runs `cembed ARGS` in this interpreter and, at exit (after typer's SystemExit), prints which heavy
# libraries were imported: what a fast answer must not have paid for.
_RUN_AND_REPORT = (
    "import atexit, sys, runpy\n"
    "atexit.register(lambda: print('HEAVY=' + ','.join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr))\n"
    "sys.argv = ['cembed', *{args!r}]\n"
    "runpy.run_module('cembed', run_name='__main__')\n"
)


def heavy_imports(args: list[str], cwd) -> tuple[int, str, list[str]]:
    """``(exit code, output, heavy libraries imported)`` of ``cembed ARGS`` in a fresh interpreter."""
    code = _RUN_AND_REPORT.format(heavy=HEAVY, args=list(args))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300)
    marker = [line for line in r.stderr.splitlines() if line.startswith("HEAVY=")]
    assert marker, r.stderr[-2000:]
    return r.returncode, r.stdout + r.stderr, [m for m in marker[-1][len("HEAVY=") :].split(",") if m]


@pytest.mark.slow
def test_suggest_lr_and_help_import_no_training_library(tmp_path):
    rc, out, heavy = heavy_imports(["suggest-lr", "--base-lr", "2e-5", "--base-bs", "32", "--bs", "65536"], tmp_path)
    assert rc == 0 and "suggested learning_rate: 9.051e-04" in out
    assert heavy == []
    rc, out, heavy = heavy_imports(["--help"], tmp_path)
    assert rc == 0 and "suggest-lr" in out and heavy == []


@pytest.mark.slow
def test_a_config_mistake_is_reported_before_any_training_library_loads(tmp_path):
    """A typo'd key (the commonest mistake) answers in a second, not after importing torch."""
    (tmp_path / "run.yaml").write_text("model:\n  name_or_path: all-MiniLM-L6-v2\n  nmae: x\ndata:\n  train: x.jsonl\n")
    for command in ("validate", "train", "inspect-data", "probe-minibatch"):
        rc, out, heavy = heavy_imports([command, "run.yaml"], tmp_path)
        assert rc == 2 and "run.yaml:3: unknown key 'model.nmae'" in out, (command, out)
        assert heavy == [], command


@pytest.mark.slow
def test_init_example_imports_no_training_library(tmp_path):
    rc, out, heavy = heavy_imports(["init", "quick.yaml", "--example", "quickstart"], tmp_path)
    assert rc == 0 and (tmp_path / "quick.yaml").read_text().startswith("# Fine-tune")
    assert heavy == []


def _click_commands():
    import typer.main

    return typer.main.get_command(app).commands


def test_every_command_answers_dash_h_with_examples():
    from typer.testing import CliRunner

    for name in COMMANDS:
        short, long = CliRunner().invoke(app, [name, "-h"]), CliRunner().invoke(app, [name, "--help"])
        assert short.exit_code == 0 and short.output == long.output, name
        assert "Examples" in short.output and f"cembed {name} " in short.output.split("Examples")[1], name


def test_every_example_names_its_command_and_only_options_it_has():
    """The examples at the end of each --help are commands that parse: the right command name, and
    every --option one it declares (so a renamed flag cannot leave a stale example)."""
    import shlex

    for name, command in _click_commands().items():
        examples = [line.strip() for line in (command.epilog or "").splitlines() if line.strip().startswith("cembed ")]
        assert len(examples) >= 2, name
        options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        for example in examples:
            words = shlex.split(example.split(" | ")[0].split(" && ")[0])
            assert words[:2] == ["cembed", name], example
            unknown = [w for w in words if w.startswith("-") and w.split("=")[0] not in options]
            assert unknown == [], (example, unknown)


def test_version_prints_the_installed_package_version():
    from importlib.metadata import version

    from typer.testing import CliRunner

    import cembed

    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"cembed {version('cembed')}"
    assert cembed.__version__ == version("cembed")


def test_a_bad_choice_is_refused_by_the_parser_naming_the_allowed_values():
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["probe-minibatch", "--model", "x", "--precision", "fp8"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert all(f"'{v}'" in r.output for v in ("auto", "fp32", "bf16", "fp16")), r.output
    r = CliRunner().invoke(app, ["suggest-lr", "--base-lr", "2e-5", "--base-bs", "32", "--bs", "64", "--rule", "cube"])
    assert r.exit_code == 2 and "'sqrt'" in r.output and "'linear'" in r.output


def test_help_lists_the_choices_and_shows_no_bool_value():
    """Choices appear as ``<a|b>``; a boolean option is a ``--flag/--no-flag`` pair, never an option
    that seems to take a ``<bool>`` value, the ``-h/--help`` row included, in every command's help
    and the app's own."""
    from typer.testing import CliRunner

    helps = {name: CliRunner().invoke(app, [name, "-h"], env={"COLUMNS": "200"}).output for name in COMMANDS}
    helps["cembed"] = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    assert all("--help" in text for text in helps.values())
    assert "<sqrt|linear>" in helps["suggest-lr"]
    assert "<auto|fp32|bf16|fp16>" in helps["probe-minibatch"] and "<auto|cpu|cuda>" in helps["probe-minibatch"]
    assert "<auto|cpu|cuda>" in helps["eval"] and "<columns|rows>" in helps["mine-negatives"]
    for name, text in helps.items():
        rows = [line for line in text.splitlines() if "<bool>" in line]
        assert rows == [], (name, rows)
    for name, command in _click_commands().items():
        for p in command.params:
            if getattr(p, "is_flag", False) and p.name != "help":
                assert p.secondary_opts and p.secondary_opts[0].startswith("--no-"), (name, p.opts)


def test_cli_choices_match_the_config_schema():
    """The CLI's choice lists are the schema's (or the library's) allowed values, so they cannot drift."""
    from typing import get_args

    from cembed.cli import common
    from cembed.config.schema import ModelConfig
    from cembed.data.mining import OutputFormat
    from cembed.plan.lr import Rule

    assert get_args(common.Precision) == get_args(ModelConfig.model_fields["precision"].annotation)
    assert get_args(common.Device) == get_args(ModelConfig.model_fields["device"].annotation)
    assert get_args(common.OutputFormat) == get_args(OutputFormat)
    assert set(get_args(common.LRRule)) == set(get_args(Rule)) - {"none"}
