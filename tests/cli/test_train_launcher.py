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


def test_the_launcher_says_what_its_signalled_workers_left(
    write_config, pairs_file, tiny_model_dir, monkeypatch, tmp_path
):
    """After a SIGTERM the launcher reads what rank 0 wrote in this launch: a run the workers finished
    within train.stop_grace_seconds (a signal after its last step) exits 0 without a resume command
    (which would be refused: the run is finished); an abandoned one names the step; else the newest
    checkpoint and the resume command."""
    import json
    import signal

    import cembed.distributed.launch
    from cembed.cli.app import app
    from cembed.errors import LauncherSignalled
    from cembed.train.checkpoint import mark_complete

    folder = tmp_path / "out"
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(40)))},
            "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
            "train": {"output_dir": str(folder)},
        }
    )
    left: dict = {}

    def launch(*args, **kwargs):
        folder.mkdir(exist_ok=True)
        if left:
            (folder / "run_summary.json").write_text(json.dumps(left))
        raise LauncherSignalled(signal.SIGTERM, abandoned=left.get("status") == "abandoned")

    monkeypatch.setattr(cembed.distributed.launch, "launch", launch)
    left.update(status="completed")
    r = CliRunner().invoke(app, ["train", str(cfg), "--nproc-per-node", "2"])
    assert r.exit_code == 0, r.output
    assert r.output.strip().splitlines()[-1] == (
        f"SIGTERM: the run was finished within train.stop_grace_seconds (90 s); model and run_summary.json in {folder}"
    )
    (folder / "checkpoint-6").mkdir()
    mark_complete(folder / "checkpoint-6", 6)
    left.clear()
    left.update(status="abandoned", abandoned="step 7")
    r = CliRunner().invoke(app, ["train", str(cfg), "--nproc-per-node", "2", "--resume"])
    assert r.exit_code == 143, r.output
    assert r.output.strip().splitlines()[-2:] == [
        f"abandoned step 7 (SIGTERM again): not saved; the last complete checkpoint is {folder / 'checkpoint-6'}",
        f"resume with: cembed train {cfg} --resume",
    ]
    left.clear()
    left.update(status="interrupted", steps=6)
    r = CliRunner().invoke(app, ["train", str(cfg), "--nproc-per-node", "2", "--resume"])
    assert r.exit_code == 143, r.output
    assert r.output.strip().splitlines()[-2:] == [
        f"interrupted by SIGTERM: newest checkpoint {folder / 'checkpoint-6'}",
        f"resume with: cembed train {cfg} --resume",
    ]
