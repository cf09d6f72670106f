"""scripts/study_batch_size.py end to end on the tiny model: every configuration trained through cembed
and scored on the real SciFact test split, the table, plot and JSON written."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, SHARED_DATA, load_script

pytestmark = [
    pytest.mark.slow,  # tests/e2e: whole runs
    pytest.mark.skipif(not (SHARED_DATA / "scifact").exists(), reason="../shared/data is not present"),
]


def _load_script():
    return load_script(REPO / "scripts" / "study_batch_size.py", "study_batch_size")


def test_scifact_train_pairs_join_qrels_queries_and_corpus():
    study = _load_script()
    pairs = study.scifact_train_pairs(SHARED_DATA / "scifact")
    assert len(pairs) == 919  # qrels/train.tsv rows with score > 0
    assert len({p["positive"] for p in pairs}) == 565
    assert all(p["anchor"] and p["positive"] for p in pairs)


def test_study_smoke_run_writes_table_plot_and_json(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "cache"))
    study = _load_script()
    out = tmp_path / "docs"
    rc = study.main(
        [
            "--model",
            str(tiny_model_dir),
            "--batch-sizes",
            "8",
            "16",
            "--base-batch-size",
            "8",
            "--max-train-pairs",
            "64",
            "--max-seq-length",
            "32",
            "--mini-batch-size",
            "8",
            "--eval-batch-size",
            "256",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--work-dir",
            str(tmp_path / "runs"),
        ]
    )
    assert rc == 0
    report = json.loads((out / "batch_size_study.json").read_text())
    rows = {(r["batch_size"], r["lr_scaling"]): r for r in report["results"]}
    assert set(rows) == {(8, "sqrt"), (8, "none"), (16, "sqrt"), (16, "none")}
    assert rows[(8, "none")]["same_run_as"] == "sqrt"  # batch == base batch: one run, not two
    assert rows[(16, "sqrt")]["learning_rate"] == pytest.approx(2e-5 * 2**0.5)
    assert rows[(16, "none")]["learning_rate"] == pytest.approx(2e-5)
    # one epoch of duplicate-free batches (47 distinct positives in 64 rows): fewer steps at batch 16
    assert rows[(16, "sqrt")]["steps"] == rows[(16, "none")]["steps"] < rows[(8, "sqrt")]["steps"] <= 64 // 8
    assert all(0.0 <= r["ndcg@10"] <= 1.0 for r in rows.values())
    md = (out / "batch_size_study.md").read_text()
    assert md.count("\n| 16 |") == 2 and "(same run as sqrt)" in md
    assert (out / "batch_size_study.png").stat().st_size > 0
