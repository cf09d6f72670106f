"""``cembed validate`` on a streamed source (``data.train.streaming``): only the first rows are
read and checked, the rows are not counted, and what training would refuse is refused."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

import cembed.train.recipe as T
from cembed.config.file import config_from_dict
from cembed.errors import UserError

pytestmark = pytest.mark.slow  # runs `cembed validate` in a subprocess

ROWS = [{"anchor": f"a dog {i} in the park", "positive": f"a puppy {i} on grass"} for i in range(3000)]


def _config(model_dir, data_file, tmp_path, **data):
    return {
        "model": {"name_or_path": str(model_dir), "device": "cpu"},
        "data": {"train": {"path": str(data_file), "streaming": {"check_rows": 100}}, **data},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "train": {"max_steps": 2, "output_dir": str(tmp_path / "out")},
    }


def _validate(path, *flags):
    cmd = [sys.executable, "-m", "cembed", "validate", str(path), *flags]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_validate_reads_only_the_first_rows_of_a_stream(tiny_model_dir, tmp_path, write_config):
    """Row 2,501 has no anchor: a full read would refuse it; validate checks the first 100 rows,
    says the stream's rows are not counted and reports no batch count."""
    rows = [dict(r) for r in ROWS]
    rows[2500]["anchor"] = None
    data_file = tmp_path / "pairs.jsonl.gz"
    with gzip.open(data_file, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    path = write_config(_config(tiny_model_dir, data_file, tmp_path))
    r = _validate(path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "a stream (rows not counted); its first 100 rows checked (columns, cells)" in r.stdout
    assert "window of 4 batches" in r.stdout and "steps: 2 optimizer steps (train.max_steps)" in r.stdout
    facts = json.loads(_validate(path, "--json").stdout)["data"]
    assert facts["rows"] is None and facts["batches_per_epoch"] is None
    assert facts["sources"][0]["rows_checked"] == 100 and facts["streaming"]["window_batches"] == 4
    # Several processes: the rule holds over the global batch, and the line says what each rank reads.
    from typer.testing import CliRunner

    from cembed.cli.app import app

    two = CliRunner().invoke(app, ["validate", str(path), "--nproc-per-node", "2"])
    assert two.exit_code == 0, two.output
    assert (
        "no-duplicate batches (global batches of 2 processes: each reads the whole stream and trains its slice) "
        "over a window of 4 batches"
    ) in " ".join(two.output.split())
    # Without streaming the same file is read whole, and row 2,501 refused.
    plain = _config(tiny_model_dir, data_file, tmp_path)
    del plain["data"]["train"]["streaming"]
    r = _validate(write_config(plain, name="plain.yaml"))
    assert r.returncode == 2 and "line 2501" in r.stderr, r.stderr


@pytest.fixture
def prompted_model_dir(tiny_model_dir, tmp_path):
    """The tiny model with a query prompt of its own."""
    folder = tmp_path / "prompted"
    shutil.copytree(tiny_model_dir, folder)
    settings = json.loads((folder / "config_sentence_transformers.json").read_text())
    settings["prompts"] = {"query": "query: ", "document": ""}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(settings))
    return folder


def test_the_models_own_prompts_are_refused_for_a_stream(prompted_model_dir, tmp_path, write_config):
    data_file = tmp_path / "pairs.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:200]))
    raw = _config(prompted_model_dir, data_file, tmp_path)
    r = _validate(write_config(raw))
    message = "data.train.streaming: a stream is tokenized without prompts, but anchor gets 'query: '"
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    cfg = config_from_dict(raw)
    plan, data = T.check_run_inputs(cfg)
    with pytest.raises(UserError, match="set data.prompts.anchor: '' or drop streaming"):
        T.run_training(cfg, plan, data)
    # The fix the message names: an empty anchor prompt.
    r = _validate(write_config(_config(prompted_model_dir, data_file, tmp_path, prompts={"anchor": ""})))
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_a_streamed_shard_with_another_column_is_refused_in_one_line(tiny_model_dir, tmp_path, write_config):
    """Issue 32 item 2: a streamed source gets the shard checks a loaded one gets: a shard with an
    extra column is refused naming it, in one line and exit 2, by validate and by train (it was an
    86-line CastError traceback from validate, exit 1)."""
    folder = tmp_path / "stream"
    folder.mkdir()
    (folder / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:200]))
    (folder / "part-1.jsonl").write_text("".join(json.dumps(dict(r, extra="x")) + "\n" for r in ROWS[200:400]))
    raw = _config(tiny_model_dir, folder, tmp_path)
    raw["data"]["train"]["streaming"]["check_rows"] = 300  # the head reaches the second shard
    path = write_config(raw)
    for command in ("validate", "train"):
        cmd = [sys.executable, "-m", "cembed", command, str(path)]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1, (command, r.returncode, r.stderr[-3000:])
        assert "stream/part-1.jsonl: columns anchor, positive, extra differ from" in lines[0], lines
        assert "part-0.jsonl's (anchor, positive)" in lines[0], lines
