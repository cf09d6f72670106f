"""End to end through the CLI: train a tiny model on a 512-row slice of the real COCO pairs (packaged)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import COCO_PAIRS, REPO
from sentence_transformers import SentenceTransformer

pytestmark = pytest.mark.slow  # tests/e2e: whole runs through the CLI


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


def test_evaluations_before_during_after_share_the_training_precision(tiny_model_dir, tmp_path, monkeypatch):
    """W1: with precision bf16, the evaluation before training runs under the same bf16 autocast
    as the evaluations during training (accelerate's wrapped forward) and after it, so the deltas
    are training effects, not a precision change. Every no-grad forward is recorded."""
    import torch

    import cembed.train.recipe as T
    from cembed.config.file import config_from_dict

    rows = [{"anchor": f"question {i} about a car", "positive": f"answer {i} on the street"} for i in range(16)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sts.tsv").write_text(
        "".join(f"a car on road {i}\ta vehicle on a street {i}\t{i % 5}\n" for i in range(8))
    )
    seen, real_load = [], T.load_model

    def load(*args, **kwargs):
        model = real_load(*args, **kwargs)
        model[0].register_forward_pre_hook(
            lambda module, inputs: seen.append(
                (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
                if not torch.is_grad_enabled()
                else None
            )
        )
        return model

    monkeypatch.setattr(T, "load_model", load)
    cfg = config_from_dict(
        {
            "model": {"name_or_path": str(tiny_model_dir), "max_seq_length": 16, "device": "cpu", "precision": "bf16"},
            "data": {"train": str(tmp_path / "pairs.jsonl"), "cache_dir": str(tmp_path / "cache")},
            # unpad false: packing's support check (two no-grad forwards at loss construction) is not an evaluation
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 8, "unpad": False},
            "train": {"max_steps": 2, "logging_steps": 1, "output_dir": str(tmp_path / "out")},
            "eval": {"sts": str(tmp_path / "sts.tsv"), "eval_steps": 1},
        },
        base=tmp_path,
    )
    plan, data = T.check_run_inputs(cfg)
    summary = T.run_training(cfg, plan, data)
    ev = summary["eval"]
    assert ev["before"] and ev["after"] and len(ev["during"]) == 2
    no_grad = [s for s in seen if s is not None]
    assert no_grad and all(s == (True, torch.bfloat16) for s in no_grad), no_grad
