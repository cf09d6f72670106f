"""Stored precision: a model stored in bfloat16 trains in fp32 master weights (small updates are not
rounded away), `validate` reports the stored, training and saved dtypes, and the final model is saved
in `model.save_dtype` (default: the training dtype)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import distinct_pairs
from safetensors import safe_open
from sentence_transformers import SentenceTransformer
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import config_from_dict
from cembed.config.schema import ModelConfig
from cembed.model.load import load_model, stored_dtype, weight_dtypes


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model saved with bfloat16 weights."""
    out = tmp_path_factory.mktemp("bf16") / "model"
    SentenceTransformer(str(tiny_model_dir), device="cpu").to(torch.bfloat16).save(str(out))
    return out


def changed_fraction(before, after) -> float:
    """Share of the weights in ``after``'s model.safetensors that differ from ``before``'s."""
    changed = total = 0
    with (
        safe_open(str(before / "model.safetensors"), "pt") as a,
        safe_open(str(after / "model.safetensors"), "pt") as b,
    ):
        for key in a.keys():
            x, y = a.get_tensor(key).float(), b.get_tensor(key).float()
            changed += int((x != y).sum())
            total += x.numel()
    return changed / total


def saved_dtypes(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {str(f.get_tensor(k).dtype) for k in f.keys()}


def train_3_steps(model_dir, tmp_path, name, **model_extra):
    from cembed.train.recipe import check_run_inputs, run_training

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(40)))
    data = {
        "model": {"name_or_path": str(model_dir), "device": "cpu", "precision": "fp32", **model_extra},
        "data": {"train": str(pairs), "pretokenize": False},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "optim": {"learning_rate": 2e-5, "base_batch_size": 8, "warmup_ratio": 0.0},
        "train": {"max_steps": 3, "logging_steps": 1, "output_dir": str(tmp_path / name)},
    }
    cfg = config_from_dict(data, base=tmp_path)
    plan, prepared = check_run_inputs(cfg)
    summary = run_training(cfg, plan, prepared)
    assert summary["status"] == "completed" and summary["steps"] == 3
    return tmp_path / name, summary


def test_stored_dtype_read_from_the_weights_header(tiny_model_dir, bf16_model_dir):
    assert stored_dtype(str(tiny_model_dir)) == "float32"
    assert stored_dtype(str(bf16_model_dir)) == "bfloat16"
    assert stored_dtype("owner/not-a-folder") is None


def test_bf16_stored_model_loads_fp32_for_training_and_stored_dtype_to_evaluate(bf16_model_dir):
    cfg = ModelConfig(name_or_path=str(bf16_model_dir), device="cpu", precision="bf16")
    model = load_model(cfg, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert weight_dtypes(model, cfg)._asdict() == {
        "stored": "bfloat16",
        "training": "float32",
        "autocast": "bfloat16",
        "saved": "float32",
    }
    # An explicit model_kwargs dtype is the user's choice (and reported as the training dtype).
    explicit = ModelConfig(name_or_path=str(bf16_model_dir), model_kwargs={"torch_dtype": "bfloat16"})
    pure = weight_dtypes(load_model(explicit, "cpu"), explicit)
    assert pure.training == "bfloat16" and "updates below its precision round away" in pure.describe()
    # Evaluation keeps the stored dtype.
    assert {p.dtype for p in load_model(cfg, "cpu", for_training=False).parameters()} == {torch.bfloat16}


def test_validate_reports_stored_training_and_saved_dtypes(bf16_model_dir, tmp_path, write_config):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(8)))
    cfg = write_config(
        {
            "model": {"name_or_path": str(bf16_model_dir), "device": "cpu", "precision": "bf16", "save_dtype": "bf16"},
            "data": {"train": str(pairs)},
            "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
        }
    )
    r = CliRunner().invoke(app, ["validate", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "weights: stored bfloat16, trained in float32 with bfloat16 autocast, saved as bfloat16" in r.output


@pytest.mark.slow
def test_bf16_stored_model_trains_like_fp32_and_saves_the_configured_dtype(tiny_model_dir, bf16_model_dir, tmp_path):
    # Before the fix: 14.7 % of the weights changed (bf16 rounds 2e-5 updates away), saved in bf16.
    fp32_run, _ = train_3_steps(tiny_model_dir, tmp_path, "fp32")
    bf16_run, summary = train_3_steps(bf16_model_dir, tmp_path, "bf16")
    fp32_changed = changed_fraction(tiny_model_dir, fp32_run)
    bf16_changed = changed_fraction(bf16_model_dir, bf16_run)
    assert fp32_changed > 0.9
    assert bf16_changed > 0.9 and abs(bf16_changed - fp32_changed) < 0.02  # measured: 0.951 / 0.950
    assert saved_dtypes(bf16_run) == {"torch.float32"}  # default: the training dtype
    assert json.loads((bf16_run / "config.json").read_text())["dtype"] == "float32"
    assert summary["weights"] == {"stored": "bfloat16", "training": "float32", "autocast": None, "saved": "float32"}

    named_run, summary = train_3_steps(bf16_model_dir, tmp_path, "saved-bf16", save_dtype="bf16")
    assert saved_dtypes(named_run) == {"torch.bfloat16"}
    assert json.loads((named_run / "config.json").read_text())["dtype"] == "bfloat16"
    assert summary["weights"]["saved"] == "bfloat16" and summary["plan"]["save_dtype"] == "bfloat16"
    model = SentenceTransformer(str(named_run), device="cpu")
    assert model.encode(["a red car"]).shape == (1, 32)
