"""``cembed validate`` on a sharded file source (issue 24 item 1): the file count and rows of the source."""

from __future__ import annotations

import json

from conftest import distinct_pairs, spark_folder
from typer.testing import CliRunner

from cembed.cli.app import app


def test_validate_shows_the_file_count_and_rows_of_a_folder(write_config, tiny_model_dir, tmp_path):
    rows = distinct_pairs(100)
    for k in range(20):
        part = rows[k * 5 : (k + 1) * 5]
        (tmp_path / "shards").mkdir(exist_ok=True)
        (tmp_path / "shards" / f"part-{k:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    path = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": "shards"},
            "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run")},
        }
    )
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "shards (20 files): 100 rows read, 0 dropped, 100 to train on" in text, r.output
    r = CliRunner().invoke(app, ["validate", str(path), "--json"])
    assert json.loads(r.output)["data"]["sources"][0]["files"] == 20


def test_validate_reads_a_spark_folders_parts_and_says_what_it_skipped(write_config, tiny_model_dir, tmp_path):
    """Issue 32 item 1: a folder as Spark, Hadoop and Jupyter leave it (an attempt under _temporary/,
    a .ipynb_checkpoints/ copy, _SUCCESS, .crc files, an empty partition) validates with its real
    parts and rows, and one line lists what was not read and why."""
    rows = distinct_pairs(40)
    spark_folder(tmp_path / "job", rows)
    path = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": "job"},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run")},
        }
    )
    skipped = [
        ".ipynb_checkpoints/ (hidden folder, 1 file)",
        ".part-00000-a1b2.json.crc (hidden)",
        "_SUCCESS (underscore-prefixed: Spark/Hadoop bookkeeping)",
        "_temporary/ (underscore-prefixed folder: Spark/Hadoop bookkeeping, 1 file)",
        "part-00000.crc (not a data file)",
        "part-00002-a1b2.json (0 rows)",
    ]
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 0, r.output
    assert "job (2 files): 40 rows read, 0 dropped, 40 to train on; 5 batches of 8" in r.output, r.output
    (line,) = [line for line in r.output.splitlines() if "not read in" in line]
    assert line.endswith("job: " + ", ".join(skipped)), line
    r = CliRunner().invoke(app, ["validate", str(path), "--json"])
    source = json.loads(r.output)["data"]["sources"][0]
    assert source["files"] == 2 and source["rows_read"] == 40 and source["skipped"] == skipped
