"""Issue 12 cases 7 and 8 through the CLI: what a run trained on, and rows that can never be placed."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cembed.cli import app


def _cfg(model_dir, data, out, batch: int, **train):
    return {
        "model": {"name_or_path": str(model_dir), "device": "cpu"},
        "data": {"train": str(data), "pretokenize": False},
        "batch": {"per_device_train_batch_size": batch, "mini_batch_size": 2, "drop_last": False},
        "optim": {"learning_rate": 2e-5, "base_batch_size": batch},
        "train": {"logging_steps": 1, "output_dir": str(out), "seed": 3, **train},
    }


def test_samples_seen_counts_the_rows_trained(tiny_model_dir, write_config, pairs_file, tmp_path):
    # Case 7: 42 rows t_i -> t_{i+1} at batch 8 with drop_last false: partial batches. samples_seen
    # was steps x 8 (more rows than exist); it is the rows the steps trained on: all 42, once.
    import numpy as np

    from cembed.sampler import build_batches, row_hashes

    rows = [{"anchor": f"t{i}", "positive": f"t{i + 1}"} for i in range(42)]
    data = pairs_file(rows)
    path = write_config(_cfg(tiny_model_dir, data, tmp_path / "out", 8, num_train_epochs=1))
    r = CliRunner().invoke(app, ["train", str(path)])
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    from datasets import Dataset

    hashes = row_hashes(Dataset.from_list(rows), ["anchor", "positive"])
    batches, unplaced = build_batches(hashes, 8, False, 3)
    assert unplaced == 0 and min(len(b) for b in batches) >= 2
    assert summary["steps"] == len(batches) and summary["steps"] * 8 > 42
    assert summary["samples_seen"] == 42 == sum(len(b) for b in batches)
    assert np.isclose(summary["samples_per_s"], 42 / summary["wall_time_s"], rtol=1e-2)
