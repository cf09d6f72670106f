"""``cembed validate`` on a sharded file source (issue 24 item 1): the file count and rows of the source."""

from __future__ import annotations

import json

from conftest import distinct_pairs
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
