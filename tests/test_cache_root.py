"""One cache root (cembed.files.cache_root) for tokenized data, corpus embeddings and mining, honouring
data.cache_dir / --cache-dir wherever it is given, the evaluation before training included."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from cembed.files import cache_root


def test_cache_root_kinds_and_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("CEMBED_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root("tokenized") == Path.home() / ".cache" / "cembed" / "tokenized"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root("embeddings") == tmp_path / "xdg" / "cembed" / "embeddings"
    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root("mining") == tmp_path / "env" / "mining"
    # a root the user gave wins over the environment, for every kind
    for kind in ("tokenized", "embeddings", "mining"):
        assert cache_root(kind, tmp_path / "given") == tmp_path / "given" / kind
        assert cache_root(kind, str(tmp_path / "given")) == tmp_path / "given" / kind
    with pytest.raises(ValueError, match="cache kind 'models'"):
        cache_root("models")  # type: ignore[arg-type]


def test_the_evaluation_before_training_uses_data_cache_dir(tmp_path, monkeypatch):
    from cembed.train.trainer import CembedTrainer

    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "env"))
    seen = []

    class Evaluation:
        def evaluate(self, model, label, cache_dir=None):
            seen.append((label, cache_dir))
            return {"m": 1.0}

    class Trainer:  # just what evaluate_base_model reads
        model = None

        def eval_precision(self):
            return contextlib.nullcontext()

    given = str(tmp_path / "data-cache")
    assert CembedTrainer.evaluate_base_model(Trainer(), Evaluation(), False, given) == {"m": 1.0}
    assert CembedTrainer.evaluate_base_model(Trainer(), Evaluation(), False) == {"m": 1.0}
    assert CembedTrainer.evaluate_base_model(Trainer(), Evaluation(), True, given) is None  # resuming
    assert seen == [
        ("before training", tmp_path / "data-cache" / "embeddings"),
        ("before training", tmp_path / "env" / "embeddings"),
    ]


def test_mining_cache_folder_is_under_the_root_and_keyed_by_the_model(tiny_model_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    from cembed.data.mining import mining_cache_folder
    from cembed.model.fingerprint import model_fingerprint

    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    assert mining_cache_folder(model, tmp_path) == tmp_path / "mining" / model_fingerprint(model)
