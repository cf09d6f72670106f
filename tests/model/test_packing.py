"""Issue 12 cases 7 and 8 through the CLI: what a run trained on, and rows that can never be placed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cembed.cli.app import app


def _cfg(model_dir, data, out, batch: int, **train):
    return {
        "model": {"name_or_path": str(model_dir), "device": "cpu"},
        "data": {"train": str(data), "pretokenize": False},
        "batch": {"per_device_train_batch_size": batch, "mini_batch_size": 2, "drop_last": False},
        "optim": {"learning_rate": 2e-5, "base_batch_size": batch},
        "train": {"logging_steps": 1, "output_dir": str(out), "seed": 3, **train},
    }


@pytest.mark.slow
def test_samples_seen_counts_the_rows_trained(tiny_model_dir, write_config, pairs_file, tmp_path):
    # Case 7: 42 rows t_i -> t_{i+1} at batch 8 with drop_last false: partial batches. samples_seen
    # was steps x 8 (more rows than exist); it is the rows the steps trained on: all 42, once.
    import numpy as np

    from cembed.data.batching.full_table import build_batches
    from cembed.data.identity import row_hashes

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


def _popular_negative(n: int = 64) -> list[dict]:
    # Case 8: even rows share one popular negative; a batch holds at most one of them.
    return [
        {"anchor": f"q{i}", "positive": f"p{i}", "negative": "popular negative" if i % 2 == 0 else f"n{i}"}
        for i in range(n)
    ]


UNPLACEABLE = (
    "32 of 64 rows cannot be placed in a duplicate-free batch of 16 (2 batches per epoch) and are not trained "
    "on: their texts repeat across rows, most of all column 'negative' (role negative_1): 'popular negative' is "
    "in 32 rows"
)


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.slow
def test_unplaceable_rows_reported_by_validate_inspect_data_and_train(
    tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch
):
    # Case 8: validate said OK and train left half the rows out, said only in run_summary.json. Now
    # validate, inspect-data and the start of train say how many rows and why.
    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "cache"))
    cfg = _cfg(tiny_model_dir, pairs_file(_popular_negative()), tmp_path / "out", 16, num_train_epochs=1)
    cfg["batch"]["drop_last"] = True
    cfg["data"]["columns"] = {"anchor": "anchor", "positive": "positive", "negatives": ["negative"]}
    path = write_config(cfg)
    runner = CliRunner()
    for command in ("validate", "inspect-data", "train"):
        r = runner.invoke(app, [command, str(path)], terminal_width=400)
        assert r.exit_code == 0, r.output
        assert UNPLACEABLE in _flat(r.output), (command, r.output)
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["data"]["rows_unplaced_first_epoch"] == 32
    assert summary["samples_seen"] == 32
    # Placeable data: no warning.
    rows = [{"anchor": f"q{i}", "positive": f"p{i}", "negative": f"n{i}"} for i in range(64)]
    cfg["data"]["train"] = str(pairs_file(rows, "ok.jsonl"))
    r = runner.invoke(app, ["validate", str(write_config(cfg))], terminal_width=400)
    assert r.exit_code == 0 and "cannot be placed" not in r.output, r.output


def test_inspect_data_compares_texts_as_the_model_sees_them(
    tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch
):
    # Case 4 (inspect-data): three spellings of one caption are one text to the uncased tokenizer:
    # 3 of 8 rows share a text (was 0.00%, comparing raw text).
    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "cache"))
    same = ["A red car on the street.", "a red car on the street. ", "A RED CAR ON THE STREET."]
    rows = [{"anchor": f"question {i}", "positive": p} for i, p in enumerate(same + [f"{w} dog" for w in "abcde"])]
    cfg = _cfg(tiny_model_dir, pairs_file(rows), tmp_path / "out", 2)
    cfg["data"]["pretokenize"] = True  # the sampler compares token ids only when training pre-tokenizes
    r = CliRunner().invoke(app, ["inspect-data", str(write_config(cfg))], terminal_width=400)
    assert r.exit_code == 0, r.output
    assert "37.50%" in r.output and "token ids" in r.output, r.output
    assert "6 found (at most 6)" in r.output  # one of the three spellings per batch: 5 + 1
    # Without a loadable model: raw text, and the report says so.
    cfg["model"]["name_or_path"] = str(tmp_path / "no-such-model")
    r = CliRunner().invoke(app, ["inspect-data", str(write_config(cfg))], terminal_width=400)
    assert r.exit_code == 0, r.output
    assert "0.00%" in r.output and "raw text (model not" in r.output, r.output
