"""End to end through the CLI: train a tiny model on a 512-row slice of the real COCO pairs (packaged)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import COCO_PAIRS, REPO
from sentence_transformers import SentenceTransformer


def test_cli_train_on_coco_slice(tiny_model_dir, write_config, tmp_path):
    out = tmp_path / "run"
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "max_seq_length": 32, "device": "cpu"},
            "data": {"train": str(COCO_PAIRS), "max_samples": 512},
            "batch": {"per_device_train_batch_size": 64, "mini_batch_size": 16},
            "optim": {"learning_rate": 1e-3, "base_batch_size": 64, "warmup_ratio": 0.0},
            "train": {"num_train_epochs": 3, "logging_steps": 2, "output_dir": str(out)},
        }
    )
    r = subprocess.run(
        [sys.executable, "-m", "cembed", "train", str(cfg)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "run_summary.json").read_text())
    for key in (
        "config",
        "learning_rate",
        "steps",
        "samples_seen",
        "wall_time_s",
        "samples_per_s",
        "first_loss",
        "last_loss",
        "device",
        "versions",
    ):
        assert key in summary, key
    assert summary["device"] == "cpu" and summary["status"] == "completed"
    assert summary["steps"] == 3 * summary["data"]["batches_per_epoch"]
    assert summary["samples_seen"] == summary["steps"] * 64
    assert summary["last_loss"] < summary["first_loss"]
    assert [s for s, _ in summary["step_losses"]] == list(range(1, summary["steps"] + 1))
    model = SentenceTransformer(str(out), device="cpu")
    emb = model.encode(["A man riding a bus.", "Two dogs on a beach."])
    assert emb.shape == (2, 32)
