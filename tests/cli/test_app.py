"""The command line's shape: which commands exist, and that importing it stays light."""

from __future__ import annotations

import subprocess
import sys

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
]


def test_registered_commands_are_the_expected_ones():
    """A command added, renamed or dropped is a deliberate change to this list (litgpt's guard)."""
    assert [c.name for c in app.registered_commands] == COMMANDS


def test_importing_the_cli_loads_no_training_library():
    """``cembed --help`` stays fast: command modules import torch, transformers, datasets and
    sentence-transformers inside their commands only."""
    heavy = ["torch", "transformers", "datasets", "sentence_transformers"]
    code = f"import sys, cembed.cli.app; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_rich_run_display_without_progress_prints_only_what_the_run_is():
    from cembed.cli.train import RichRunDisplay

    console = Console(record=True, width=200)
    display = RichRunDisplay(console, progress=False)
    assert display.progress(None, 8) is None
    display.log_line("step 1/2 loss 1.0")
    display.eval_line("eval before training: s 0.5")
    display.probe_start("cpu")
    assert console.export_text() == "probing mini_batch_size on cpu (batch.mini_batch_size: auto)\n"


def test_rich_run_display_progress_is_a_trainer_callback():
    from transformers import TrainerCallback

    from cembed.cli.train import RichProgress, RichRunDisplay
    from cembed.train.trainer import RunLog

    console = Console(record=True, width=200)
    display = RichRunDisplay(console)
    bar = display.progress(RunLog(), 8)
    assert isinstance(bar, TrainerCallback) and isinstance(bar, RichProgress)
    assert type(bar).__name__ == "RichProgressCallback"
    display.log_line("before the bar starts: not shown")
    display.eval_line("eval before training: s 0.5")
    assert console.export_text() == "eval before training: s 0.5\n"
