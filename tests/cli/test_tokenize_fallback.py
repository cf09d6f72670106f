"""Issue 32 item 5e: when pre-tokenizing falls back (the tokenizer's ids differ from the model's own
preprocessing), ``validate`` and the start of ``train`` say so, not only ``run_summary.json``."""

from __future__ import annotations

import json

import pytest
from conftest import distinct_pairs
from typer.testing import CliRunner

import cembed.data.tokens.tokenize as T
from cembed.cli.app import app

WARNING = "data.pretokenize: the ids the tokenizer gives differ from the model's own preprocessing"


@pytest.fixture
def differing(monkeypatch):
    """The first rows' check fails, as it does for a model whose preprocessing changes the texts."""
    monkeypatch.setattr(T, "matches_model_preprocessing", lambda *args, **kwargs: False)


def _config(write_config, pairs_file, tiny_model_dir, tmp_path):
    return write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(32))), "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
        }
    )


def test_validate_warns_of_the_fallback(differing, write_config, pairs_file, tiny_model_dir, tmp_path):
    cfg = _config(write_config, pairs_file, tiny_model_dir, tmp_path)
    r = CliRunner().invoke(app, ["validate", str(cfg)])
    assert r.exit_code == 0, r.output
    assert WARNING in " ".join(r.output.split()), r.output
    report = json.loads(CliRunner().invoke(app, ["validate", str(cfg), "--json"]).output)
    assert any(w.startswith(WARNING) for w in report["warnings"]), report["warnings"]


def test_validate_without_the_fallback_does_not_warn(write_config, pairs_file, tiny_model_dir, tmp_path):
    r = CliRunner().invoke(app, ["validate", str(_config(write_config, pairs_file, tiny_model_dir, tmp_path))])
    assert r.exit_code == 0 and "data.pretokenize" not in r.output, r.output


@pytest.mark.slow
def test_train_warns_of_the_fallback_before_it_trains(differing, write_config, pairs_file, tiny_model_dir, tmp_path):
    cfg = _config(write_config, pairs_file, tiny_model_dir, tmp_path)
    r = CliRunner().invoke(app, ["train", str(cfg)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert WARNING in text and text.index(WARNING) < text.index("done:"), r.output
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["tokenization"]["pretokenized"] is False
    assert summary["tokenization"]["warning"].startswith(WARNING)
