"""The launcher of a multi-process run checks the config only and never loads the table (issue 24
item 3: a node's memory is its ranks'); the workers check the data (their error comes back through
the launcher, see tests/distributed/test_distributed.py)."""

from __future__ import annotations

from conftest import distinct_pairs
from typer.testing import CliRunner


def test_launcher_checks_the_config_but_loads_no_data(write_config, pairs_file, tiny_model_dir, monkeypatch):
    import cembed.data.batchable
    import cembed.distributed.launch
    import cembed.train.recipe
    from cembed.cli.app import app

    launched = []

    def no_load(*args, **kwargs):
        raise AssertionError("the launcher loaded the training data")

    monkeypatch.setattr(cembed.distributed.launch, "launch", lambda args, *rest, **kw: launched.append(args))
    monkeypatch.setattr(cembed.data.batchable, "load_checked_data", no_load)
    monkeypatch.setattr(cembed.train.recipe, "load_checked_data", no_load)
    rows = distinct_pairs(40)
    rows[5]["positive"] = "   "  # a bad cell: the workers refuse it, not the launcher
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(rows))},
            "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
        }
    )
    r = CliRunner().invoke(app, ["train", str(cfg), "--nproc-per-node", "2"])
    assert r.exit_code == 0, r.output
    assert launched and launched[0][0] == "train"
    assert "launching 2 process(es)" in r.output and "world size: 2" in r.output
    # A config mistake still answers here, before any process starts.
    bad = write_config({**{"data": {"train": str(pairs_file(rows))}}, "batch": {"per_device_train_batch_size": 0}})
    r = CliRunner().invoke(app, ["train", str(bad), "--nproc-per-node", "2"])
    assert r.exit_code == 2 and len(launched) == 1, r.output
