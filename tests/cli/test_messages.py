"""What a user reads: one clean error line (no library log lines), paths relative to the working
directory, lines broken between words on a terminal and never in a pipe."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import pytest

from cembed.cli.common import word_wrapping_console


@pytest.mark.slow
def test_csv_named_jsonl_is_one_clean_error_line_with_a_relative_path(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.jsonl").write_text("anchor,positive\nhello,world\nfoo,bar\n")
    (tmp_path / "c.yaml").write_text(
        textwrap.dedent(
            """\
            model: {name_or_path: all-MiniLM-L6-v2}
            data: {train: data/x.jsonl}
            batch: {per_device_train_batch_size: 2, mini_batch_size: 2}
            train: {max_steps: 1, output_dir: out}
            """
        )
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "cembed", "validate", str(tmp_path / "c.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert r.returncode == 2
    # datasets logs "Failed to load JSON from file '/tmp/.../x.jsonl' with error <class
    # 'pyarrow.lib.ArrowInvalid'>" before raising; only cembed's line may reach the user.
    assert r.stdout + r.stderr == "error: data/x.jsonl: invalid JSON on line 1, column 1: Expecting value\n"


def test_config_error_names_the_config_relative_to_the_working_directory(tmp_path, monkeypatch):
    from cembed.config.file import load_config
    from cembed.errors import UserError

    (tmp_path / "configs").mkdir()
    monkeypatch.chdir(tmp_path)
    try:
        load_config(tmp_path / "configs" / "missing.yaml")
    except UserError as err:
        assert str(err) == "configs/missing.yaml: config file not found"
    else:
        raise AssertionError("no UserError")


LONG = (
    "error: data.train: /home/someone/projects/embeddings/data/training_pairs.jsonl holds 3 rows, fewer than "
    "per_device_train_batch_size (128); lower the batch size or add rows"
)


def test_terminal_lines_break_between_words():
    out = io.StringIO()
    console = word_wrapping_console(file=out, force_terminal=True, width=64, color_system=None)
    console.print(LONG, highlight=False)
    lines = out.getvalue().splitlines()
    assert len(lines) > 1 and all(len(line) <= 64 for line in lines)
    words = set(LONG.split())
    assert all(w in words for line in lines for w in line.split()), lines  # no word cut in two


def test_piped_output_keeps_each_message_on_one_line():
    out = io.StringIO()
    console = word_wrapping_console(file=out, width=50)  # not a terminal
    console.print(LONG, highlight=False)
    assert out.getvalue() == LONG + "\n"


@pytest.mark.slow
def test_validate_names_the_data_file_relative_to_the_working_directory(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cembed.cli.app import app

    (tmp_path / "data").mkdir()
    rows = [f'{{"anchor": "question {i}", "positive": "answer {i}"}}' for i in range(8)]
    (tmp_path / "data" / "pairs.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "c.yaml").write_text(
        "model: {name_or_path: all-MiniLM-L6-v2}\ndata: {train: data/pairs.jsonl}\n"
        "batch: {per_device_train_batch_size: 4, mini_batch_size: 4}\ntrain: {max_steps: 1, output_dir: out}\n"
    )
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["validate", str(tmp_path / "c.yaml")])
    assert r.exit_code == 0, r.output
    assert "data: data/pairs.jsonl: 8 rows read, 0 dropped, 8 to train on;" in r.output
