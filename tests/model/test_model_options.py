"""Model options real checkpoints need (remote code, revision, kwargs, pooling) and models cembed
refuses to train (StaticEmbedding)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import distinct_pairs
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.schema import ModelConfig
from cembed.errors import ModelRefused
from cembed.model.load import load_eval_model, load_model, pooling_in_effect


@pytest.fixture(scope="module")
def plain_checkpoint(tiny_model_dir):
    """The tiny model's plain transformers folder (config.json, no modules.json)."""
    return tiny_model_dir.parent / "hf"


@pytest.fixture(scope="module")
def remote_code_model(plain_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("remote") / "model"
    shutil.copytree(plain_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def static_model(tiny_model_dir, tmp_path_factory):
    import numpy as np
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import StaticEmbedding
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    weights = np.random.default_rng(0).random((len(tokenizer), 16), dtype=np.float32)
    folder = tmp_path_factory.mktemp("static") / "model"
    SentenceTransformer(modules=[StaticEmbedding(tokenizer.backend_tokenizer, embedding_weights=weights)]).save(
        str(folder)
    )
    return folder


def _config(write_config, pairs_file, model: dict, tmp_path) -> str:
    return str(
        write_config(
            {
                "model": {"device": "cpu", "max_seq_length": 32, **model},
                "data": {"train": str(pairs_file(distinct_pairs(16)))},
                "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
                "train": {"max_steps": 1, "output_dir": str(tmp_path / "run")},
            }
        )
    )


@pytest.mark.parametrize("command", ["validate", "train"])
def test_remote_code_without_the_option_is_one_message(command, remote_code_model, write_config, pairs_file, tmp_path):
    cfg = _config(write_config, pairs_file, {"name_or_path": str(remote_code_model)}, tmp_path)
    r = CliRunner().invoke(app, [command, cfg])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: model.trust_remote_code: "), r.output
    assert r.output.count("trust_remote_code") == 2 and "Traceback" not in r.output  # named once, in one line
    assert "auto_map: AutoModel -> modeling_custom.CustomModel" in lines[0]


def test_remote_code_is_never_enabled_silently(remote_code_model):
    with pytest.raises(ModelRefused, match=r"^model\.trust_remote_code: .* set model\.trust_remote_code: true"):
        load_model(ModelConfig(name_or_path=str(remote_code_model)), "cpu")


def test_plain_checkpoint_gets_the_configured_pooling_and_kwargs(plain_checkpoint):
    import torch

    cfg = ModelConfig(
        name_or_path=str(plain_checkpoint),
        pooling="cls",
        revision="main",
        model_kwargs={"attn_implementation": "eager", "torch_dtype": "float64"},
        tokenizer_kwargs={"model_max_length": 17},
    )
    model = load_model(cfg, "cpu")
    assert [type(m).__name__ for m in model] == ["Transformer", "Pooling"]
    assert model[1].pooling_mode == "cls"
    assert model[0].auto_model.config._attn_implementation == "eager"
    assert next(model.parameters()).dtype == torch.float64
    assert model.tokenizer.model_max_length == 17
    assert pooling_in_effect(model, cfg) == "cls (model.pooling; plain transformers checkpoint)"
    features = model.tokenize(["a man on a bus"])
    with torch.no_grad():
        out = model(features)
    assert torch.allclose(out["sentence_embedding"][0], out["token_embeddings"][0, 0])


def test_st_folder_keeps_its_own_pooling(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), pooling="cls")
    model = load_model(cfg, "cpu")
    assert model[1].pooling_mode == "mean"
    assert pooling_in_effect(model, cfg).startswith("mean (the model's sentence-transformers config")


def test_validate_prints_pooling(plain_checkpoint, write_config, pairs_file, tmp_path):
    cfg = _config(write_config, pairs_file, {"name_or_path": str(plain_checkpoint), "pooling": "lasttoken"}, tmp_path)
    r = CliRunner().invoke(app, ["validate", cfg])
    assert r.exit_code == 0, r.output
    assert "pooling: lasttoken (model.pooling; plain transformers checkpoint)" in r.output


@pytest.mark.slow
def test_train_records_revision_and_options(plain_checkpoint, write_config, pairs_file, tmp_path):
    model = {"name_or_path": str(plain_checkpoint), "revision": "main", "pooling": "cls"}
    model["model_kwargs"] = {"attn_implementation": "eager"}
    cfg = _config(write_config, pairs_file, model, tmp_path)
    r = CliRunner().invoke(app, ["train", cfg])
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    recorded = summary["config"]["model"]
    assert recorded["revision"] == "main" and recorded["pooling"] == "cls" and not recorded["trust_remote_code"]
    assert recorded["model_kwargs"] == {"attn_implementation": "eager"}


@pytest.mark.parametrize("command", ["validate", "train", "probe-minibatch"])
def test_static_embedding_refused_in_one_line(command, static_model, write_config, pairs_file, tmp_path):
    cfg = _config(write_config, pairs_file, {"name_or_path": str(static_model)}, tmp_path)
    args = [command, cfg] + (["--max", "4", "--max-memory", "2GiB"] if command == "probe-minibatch" else [])
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert (
        "is a StaticEmbedding model (sentence_transformers.models.StaticEmbedding); cembed cannot train it" in r.output
    )
    assert "attention mask" in r.output and "Traceback" not in r.output


def test_static_embedding_can_still_be_evaluated(static_model):
    assert type(load_eval_model(str(static_model), "cpu")[0]).__name__ == "StaticEmbedding"
