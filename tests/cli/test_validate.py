"""``cembed validate``'s output: a short summary a person reads (issue 23 item 11: it opened with
~100 lines of resolved-config JSON), the full resolved config only with ``--verbose``, and one
machine-readable JSON object with ``--json``."""

from __future__ import annotations

import json

from conftest import distinct_pairs
from typer.testing import CliRunner

from cembed.cli.app import app


def _config(write_config, pairs_file, tiny_model_dir, tmp_path, **train):
    return write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file([*distinct_pairs(100), {"anchor": "x", "positive": "y", "id": 7}]))},
            "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4},
            "optim": {"learning_rate": 2e-5, "base_batch_size": 4, "lr_scaling": "sqrt", "warmup_ratio": 0.1},
            "train": {"output_dir": str(tmp_path / "run"), **train},
        }
    )


def test_default_output_is_a_short_summary(write_config, pairs_file, tiny_model_dir, tmp_path):
    r = CliRunner().invoke(app, ["validate", str(_config(write_config, pairs_file, tiny_model_dir, tmp_path))])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) < 25, r.output
    assert not any(line.strip() in ("{", "}") or line.strip().startswith('"') for line in lines), r.output
    assert "resolved config" not in lines and '"name_or_path"' not in r.output
    text = " ".join(r.output.split())
    # what will train, on what, how big and how fast, what is wrong
    assert lines[0].startswith(f"model: {tiny_model_dir} (max_seq_length ") and "pooling: mean" in lines[0]
    assert "loss: cached_mnrl on anchor, positive" in text
    # 101 rows, batch 16, drop_last: 6 batches per epoch; 1 epoch -> 6 steps, ceil(0.6) = 1 of warmup
    assert "101 rows read, 0 dropped, 101 to train on; 6 batches of 16 per epoch" in text
    assert "first row: anchor 'question number 0' | positive 'answer text 0'" in text
    assert "= 16 samples per optimizer step" in text and "mini_batch_size: 4" in text
    assert "effective learning_rate: 4.000e-05 = 2e-05 x sqrt(16/4) (lr_scaling: sqrt)" in text
    assert "steps: 6 optimizer steps (train.num_train_epochs: 1), 1 of them warmup; an epoch is 6 steps" in text
    assert "column(s) id are not mapped in data.columns" in text  # the warning, in the summary
    assert lines[-1].startswith("config OK") and "--verbose" in lines[-1]


def test_steps_follow_max_steps(write_config, pairs_file, tiny_model_dir, tmp_path):
    cfg = _config(write_config, pairs_file, tiny_model_dir, tmp_path, max_steps=40)
    r = CliRunner().invoke(app, ["validate", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "steps: 40 optimizer steps (train.max_steps), 4 of them warmup; an epoch is 6 steps" in r.output


def test_verbose_adds_the_full_resolved_config(write_config, pairs_file, tiny_model_dir, tmp_path):
    path = _config(write_config, pairs_file, tiny_model_dir, tmp_path)
    short = CliRunner().invoke(app, ["validate", str(path)]).output
    r = CliRunner().invoke(app, ["validate", str(path), "--verbose"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(short.splitlines()[0])  # the summary comes first
    start = r.output.index("resolved config\n") + len("resolved config\n")
    end = r.output.index("\n}\n", start) + 2
    config = json.loads(r.output[start:end])
    assert config["batch"]["per_device_train_batch_size"] == 16 and config["optim"]["warmup_ratio"] == 0.1
    assert config["train"]["output_dir"] == str(tmp_path / "run")
    assert "first training row" in r.output and "rows > max_seq_length" in r.output


def test_json_prints_one_object_and_nothing_else(write_config, pairs_file, tiny_model_dir, tmp_path):
    r = CliRunner().invoke(
        app, ["validate", str(_config(write_config, pairs_file, tiny_model_dir, tmp_path)), "--json"]
    )
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["config"]["batch"]["mini_batch_size"] == 4
    assert report["data"]["rows"] == 101 and report["data"]["batches_per_epoch"] == 6
    assert report["steps"] == {"total": 6, "from": "train.num_train_epochs: 1", "per_epoch": 6, "warmup": 1}
    assert report["learning_rate"]["effective"] == 4e-05
    assert report["loss"] == {"name": "cached_mnrl", "columns": {"anchor": "anchor", "positive": "positive"}}
    assert len(report["warnings"]) == 1 and "column(s) id are not mapped" in report["warnings"][0]


def test_a_sparse_folders_max_active_dims_is_shown_on_the_model_line_and_in_json(write_config, pairs_file, tmp_path):
    """A ``SparseEncoder`` folder saved with ``max_active_dims`` (its ``config_sentence_transformers.json``):
    encoding keeps each vector's largest coordinates only, which changes retrieval. ``validate``'s model line
    states the cap and where it comes from, ``--json`` has it as ``model.max_active_dims``; a folder without
    one: null, and the line says nothing of a cap."""
    from conftest import make_tiny_splade

    splade = make_tiny_splade(tmp_path / "src", bias=-0.1)
    splade.max_active_dims = 5
    splade.save(str(tmp_path / "capped"))
    splade.max_active_dims = None
    splade.save(str(tmp_path / "uncapped"))
    assert json.loads((tmp_path / "capped" / "config_sentence_transformers.json").read_text())["max_active_dims"] == 5
    data = str(pairs_file(distinct_pairs(16)))
    for name, cap in (("capped", 5), ("uncapped", None)):
        config = write_config(
            {
                "model": {"kind": "sparse", "name_or_path": str(tmp_path / name), "device": "cpu"},
                "data": {"train": data, "cache_dir": str(tmp_path / "cache")},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
                "train": {"output_dir": str(tmp_path / f"run_{name}"), "max_steps": 1},
            }
        )
        r = CliRunner().invoke(app, ["validate", str(config)])
        assert r.exit_code == 0, r.output
        line = r.output.splitlines()[0]
        assert line.startswith(f"model: {tmp_path / name} ") and "kind: sparse" in line, line
        if cap is None:
            assert "max_active_dims" not in line, line
        else:
            assert line.endswith(
                "127-dim sparse vectors, dot (the model's SparseEncoder config); max_active_dims 5 (the folder's "
                "config): encoding keeps each text's 5 largest coordinates (retrieval and cembed eval; the loss "
                "trains on every active one)"
            ), line
        r = CliRunner().invoke(app, ["validate", str(config), "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["model"]["max_active_dims"] == cap
